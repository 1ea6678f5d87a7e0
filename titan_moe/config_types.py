"""The one type check of configuration values, for TOML tables, command lines and model fields.

    value_matches(hint, value)      a TOML (or Python) value against a field's type
    cli_values_match(hint, values)  the strings that follow `--section.key` on a command line
    type_name(hint)                 the type as an error message names it

Hints are resolved annotations (`typing.get_type_hints`): bool, int, float, str, Literal[...],
X | None, list[X] / tuple[X, ...]. An int is a float (TOML writes `1` for 1.0); a bool is
never an int. A type outside these is left to the parser that owns it (tyro).
"""

import types
import typing
from typing import Any, Literal

NONE_TOKEN = "None"


def value_matches(hint: Any, value: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is Literal:
        return value in args
    if origin in (types.UnionType, typing.Union):
        return any(value_matches(a, value) for a in args if a is not type(None))
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return isinstance(value, list | tuple) and all(value_matches(inner[0], v) for v in value)
    return True  # a type only tyro knows; it validates it


def cli_values_match(hint: Any, values: list[str]) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if values == [NONE_TOKEN] and type(None) in args:
            return True
        return any(cli_values_match(a, values) for a in args if a is not type(None))
    if origin in (list, tuple):
        if hint == list[str]:
            return len(values) == 1  # torchtitan parses list[str] as one "a,b,c" token
        inner = [a for a in args if a is not Ellipsis]
        return len(inner) != 1 or all(cli_values_match(inner[0], [v]) for v in values)
    if len(values) != 1:
        return False
    if origin is Literal:
        return values[0] in [str(a) for a in args]
    if hint in (int, float):
        try:
            hint(values[0])
        except ValueError:
            return False
    return True


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"a list of {type_name(inner[0])}" if len(inner) == 1 else str(hint)
    return getattr(hint, "__name__", str(hint))
