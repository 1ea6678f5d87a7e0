"""Inductor options given as KEY=VALUE text: the trainer's `compile.inductor` and bench/moe.py's
--inductor. KEY must be an option of torch._inductor.config and VALUE, read as JSON (true, 8,
0.5, "x"; a bare word is a string), of the type of that option's default, so that a misspelt
option or a value Inductor would misread is refused before anything compiles."""

import json
from collections.abc import Sequence

import torch._inductor.config


def inductor_setting(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (key, value); ValueError naming the text and what is allowed."""
    key, sep, raw = text.partition("=")
    defaults = torch._inductor.config.get_config_copy()
    if not sep or key not in defaults:
        raise ValueError(f"{text!r}: give KEY=VALUE with KEY an option of torch._inductor.config")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    default = defaults[key]
    if type(default) is float and type(value) is int:
        value = float(value)
    if default is not None and type(value) is not type(default):
        kind = type(default).__name__
        article = "an" if kind[0] in "aeiou" else "a"
        raise ValueError(f"{text!r}: {key} takes {article} {kind} (default {default!r})")
    return key, value


def inductor_settings(texts: Sequence[str], field: str) -> dict[str, object]:
    """Each KEY=VALUE of `field` parsed; ValueError naming the field, the text and what is
    allowed, or a key given twice."""
    settings = {}
    for text in texts:
        try:
            key, value = inductor_setting(text)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        if key in settings:
            raise ValueError(f"{field}: {key} is given twice")
        settings[key] = value
    return settings
