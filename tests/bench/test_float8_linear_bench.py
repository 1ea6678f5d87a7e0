"""bench/float8_linear.py on this host (--tiny: the debug flavor, emulated float8 on CPU): its
rows are the Linear shapes the `[float8]` filter converts, counted against the model's own
modules, and its summary is each recipe's per-shape time weighted by those counts. A recipe
torchao does not name is one argparse error naming --recipes.

The rows of the first shape run as the bench runs them, compiled (bf16 and emulated float8 f+b
through Inductor on CPU); the other shapes' rows run eager, which the rows and the weighting
checked here do not tell apart (each compile costs ~5 s on 2 cores)."""

import collections
import json

import pytest
import torch.nn as nn

from tests.bench_scripts import BENCH, load_bench
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("float8_linear")


def test_tiny_run_times_every_converted_shape_and_weights_the_summary(bench, tmp_path,
                                                                     monkeypatch):
    compiled_step, compiled = bench.linear_step, []

    def linear_step(in_features, out_features, *args):
        if compiled in ([], [(in_features, out_features)]):
            compiled[:] = [(in_features, out_features)]
            return compiled_step(in_features, out_features, *args)
        with monkeypatch.context() as eager:
            eager.setattr(bench.torch, "compile", lambda module, **kwargs: module)
            return compiled_step(in_features, out_features, *args)

    monkeypatch.setattr(bench, "linear_step", linear_step)
    out = tmp_path / "f8.json"
    assert bench.main(["--tiny", "--recipes", "rowwise", "--out", str(out)]) == 0
    *rows, summary = json.loads(out.read_text())["rows"]
    # The debug model's Linears with both dims >= 256 (--tiny's filter), the LM head aside.
    want = collections.Counter(
        (m.in_features, m.out_features) for name, m in TitanMoE(get_flavor("debug")).named_modules()
        if isinstance(m, nn.Linear) and name != "output"
        and min(m.in_features, m.out_features) >= 256)
    assert {(r["in"], r["out"]): r["modules"] for r in rows} == dict(want)
    assert all(r["bf16_ms"] > 0 and r["rowwise_ms"] > 0 for r in rows)
    for key in ("bf16_ms", "rowwise_ms"):
        assert summary[key] == pytest.approx(sum(r[key] * r["modules"] for r in rows))
    assert summary["rowwise_speedup"] == pytest.approx(summary["bf16_ms"] / summary["rowwise_ms"])


def test_unknown_recipe_names_the_flag(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--recipes", "rowwise,mxfp8"])
    assert "--recipes" in capsys.readouterr().err
