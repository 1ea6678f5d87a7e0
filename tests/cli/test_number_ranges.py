"""Every CLI rejects an out-of-range number as argparse's one line naming the option, exit 2,
before it builds a model or touches a device (titan_moe/cli_args.py)."""

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from titan_moe.cli_args import in_range, positive, positive_ints

REPO = Path(__file__).resolve().parents[2]


def _main(target: str):
    if target.endswith(".py"):  # a bench script: its sibling imports need bench/ on the path
        spec = importlib.util.spec_from_file_location(f"bench_{Path(target).stem}", REPO / target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    return importlib.import_module(target).main


@pytest.mark.parametrize("target, argv, option", [
    ("titan_moe.plan.cli", ["--config", "configs/debug.toml", "--gpus", "0"], "--gpus"),
    ("titan_moe.plan.cli", ["--config", "configs/debug.toml", "--gpu-mem", "-1"], "--gpu-mem"),
    ("titan_moe.serve.generate", ["--checkpoint", "x", "--prompt", "a", "--top-p", "1.5"],
     "--top-p"),
    ("titan_moe.serve.generate", ["--checkpoint", "x", "--prompt", "a", "--temperature", "-1"],
     "--temperature"),
    ("titan_moe.serve.generate", ["--checkpoint", "x", "--prompt", "a", "--max-new-tokens", "0"],
     "--max-new-tokens"),
    ("bench/step.py", ["--iters", "0"], "--iters"),
    ("bench/kda.py", ["--warmup", "-1"], "--warmup"),
    ("bench/moe.py", ["--tokens", "0"], "--tokens"),
    ("bench/long_context.py", ["--doc-len", "-5"], "--doc-len"),
    ("bench/compile.py", ["--sources", "10"], "--sources"),
    ("bench/generate.py", ["--batches", "1,0"], "--batches"),
    ("bench/float8_training.py", ["--lr", "0"], "--lr"),
    ("bench/router_precision.py", ["--seq-len", "0"], "--seq-len"),
])
def test_out_of_range_number_is_exit_2_naming_the_option(monkeypatch, capsys, target, argv,
                                                         option):
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    monkeypatch.setattr(sys, "argv", [target, *argv])
    main = _main(target)
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1].startswith(
        f"error: argument {option}: must be ")


def test_range_types():
    assert positive("3") == 3 and in_range(float, 0, 1, open_low=True)("1") == 1.0
    assert positive_ints("1,8") == [1, 8]
    for parse, text in [(positive, "0"), (positive, "1.5"), (in_range(float, 0), "nan"),
                        (positive_ints, "1,0"), (positive_ints, ",")]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
