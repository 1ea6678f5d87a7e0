"""`python -m compile_passes.inspect`: artefacts, kernel origins and graph-break reporting.

References: the blocks are known to compile without a break (they trace with fullgraph=True), a
deliberate `torch._dynamo.graph_break()` must come back with its reason, and a compiled module's
output must equal eager's.
"""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from compile_passes.inspect import inspect_compile, main, write_report
from tests.scalar_cpp import scalar_cpp

# A tiny config: every dimension small so the cold Inductor compile stays fast on 2 cores.
TINY_TOML = """
[model]
flavor = "debug"
[training]
seq_len = 16
[titan_moe]
dim = 32
vocab_size = 64
n_layers = 2
mla_layers = [2]
head_dim = 16
kda_gate_rank = 8
q_lora_rank = 16
kv_lora_rank = 16
qk_nope_head_dim = 16
qk_rope_head_dim = 8
v_head_dim = 16
dense_hidden = 32
n_experts = 4
shared_hidden = 16
latent_dim = 16
expert_hidden = 16
qb_bins = 16
"""
GRAD_RTOL = 1e-10  # compiled vs eager gradient, float64


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


def _run(block: str, config: Path, out: Path, extra: tuple[str, ...] = ()) -> str:
    stdout = io.StringIO()
    # The artefacts checked (graphs, kernel names and origins, counts) do not depend on the
    # kernels' vector width.
    with contextlib.redirect_stdout(stdout), scalar_cpp():
        rc = main(
            [
                "--config",
                str(config),
                "--block",
                block,
                "--batch",
                "2",
                "--seq-len",
                "16",
                "--out",
                str(out),
                *extra,
            ]
        )
    assert rc == 0
    return stdout.getvalue()


@pytest.fixture(scope="module", params=["attnres", "mla"])
def inspected(request, tiny_config, tmp_path_factory) -> tuple[str, Path, str]:
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, _run(request.param, tiny_config, out)


def test_writes_every_artefact(inspected):
    _, out, stdout = inspected
    for name in (
        "summary.md",
        "kernels.md",
        "kernels.json",
        "graph_breaks.md",
        "pre_grad/graph0.txt",
        "joint/graph0.txt",
        "post_grad/graph0_forward.txt",
        "post_grad/graph0_backward.txt",
        "inductor/graph0_forward.py",
        "inductor/graph0_backward.py",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert stdout == (out / "summary.md").read_text()
    # The joint graph holds the backward (tangents), the pre-grad graph does not.
    assert "tangents" in (out / "joint/graph0.txt").read_text()
    assert "tangents" not in (out / "pre_grad/graph0.txt").read_text()


def test_kernel_table_names_origin_ops(inspected):
    _, out, _ = inspected
    kernels = json.loads((out / "kernels.json").read_text())
    generated = [k for k in kernels if k["kind"] == "generated"]
    assert generated, "no Inductor kernel found"
    for phase in ("forward", "backward"):
        assert any(k["unit"].endswith(phase) for k in generated), phase
    for k in generated:
        assert k["launches"] >= 1, k
        source = (out / "inductor" / f"{k['unit']}.py").read_text()
        assert f"{k['name']} = async_compile" in source, k
    # Origins are real ATen ops, and spelled out in order they rebuild the descriptive name.
    with_origin = [k for k in generated if k["origins"]]
    assert with_origin, "no kernel traced back to an FX op"
    for k in with_origin:
        ops = [op.removeprefix("aten.") for op in k["origins"]]
        assert all(hasattr(torch.ops.aten, op) for op in ops), k
        assert re.fullmatch(rf"\w+_fused_{re.escape('_'.join(ops))}_\d+", k["name"]), k
    assert f"| `{with_origin[0]['name']}` |" in (out / "kernels.md").read_text()


def test_blocks_compile_without_breaks_or_recompiles(inspected):
    _, out, stdout = inspected
    assert "graph breaks: 0" in stdout
    assert "recompilations: 0" in stdout
    assert "dynamo graphs: 1" in stdout


def test_summary_counts_the_toml_passes(inspected):
    block, out, stdout = inspected
    # TINY_TOML sets no compile.passes: every pass is installed, as in training; only the
    # AttnRes pass has something to match in these two blocks (one site; MLA has none).
    expected = "attn_res (1 matches)" if block == "attnres" else "attn_res (0 matches)"
    assert expected in stdout and "situ_glu (0 matches)" in stdout, stdout
    if block == "attnres":
        assert "aten.cat" not in (out / "post_grad" / "graph0_forward.txt").read_text()


def test_passes_flag_overrides_the_toml(tiny_config, tmp_path):
    stdout = _run("attnres", tiny_config, tmp_path, ("--passes",))
    assert "our passes: none" in stdout, stdout
    # Without the pass the site still stacks its sources (the pass unrolls them: no cat).
    assert "aten.cat" in (tmp_path / "post_grad" / "graph0_forward.txt").read_text()


def test_toml_inductor_options_reach_the_compile(tiny_config, tmp_path):
    """`size_asserts=false` takes the wrapper's input size checks out of the output code, which
    has them by default (the reference: the same block without the option)."""
    def output_code(out: Path) -> str:
        return "".join(p.read_text() for p in sorted((out / "inductor").iterdir()))

    default = _run("attnres", tiny_config, tmp_path / "default")
    assert "inductor options: the defaults" in default, default
    assert "assert_size_stride(" in output_code(tmp_path / "default")
    config = tmp_path / "asserts_off.toml"
    config.write_text(TINY_TOML + '[compile]\ninductor = ["size_asserts=false"]\n')
    stdout = _run("attnres", config, tmp_path / "off")
    assert "inductor options: size_asserts=False" in stdout, stdout
    assert "assert_size_stride(" not in output_code(tmp_path / "off")


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return torch.cos(y)


def test_deliberate_graph_break_is_reported_with_its_reason(tmp_path):
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    steps = 2
    result = inspect_compile(_Broken(), (x,), steps=steps)
    assert result.n_graph_breaks == 1
    (reason,) = result.graph_breaks
    assert "graph_break()" in reason
    assert len(result.pre_grad) == 2  # one graph on each side of the break
    assert result.recompiles == []
    summary = write_report(result, tmp_path, "broken")
    assert "graph breaks: 1" in summary and "dynamo graphs: 2" in summary
    assert "graph_break()" in (tmp_path / "graph_breaks.md").read_text()
    # Both compiled pieces ran forward and backward: x.grad is `steps` eager gradients.
    compiled_grad = x.grad.clone()
    x.grad = None
    _Broken()(x).square().mean().backward()
    assert torch.allclose(compiled_grad, steps * x.grad, rtol=GRAD_RTOL, atol=0)


class _Counting(nn.Module):
    """Multiplies by how often it has been called: dynamo guards on the count and recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.calls


def test_recompilation_is_reported_with_its_guard():
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    result = inspect_compile(_Counting(), (x,), steps=2)
    assert result.n_graph_breaks == 0
    assert len(result.pre_grad) == 2  # the second call recompiled
    (message,) = result.recompiles
    assert "calls" in message, message
    # d/dx mean((c x)²) = 2 c² x / n, summed over the calls c = 1, 2.
    assert torch.allclose(x.grad, 2 * (1 + 4) * x.detach() / x.numel(), rtol=GRAD_RTOL, atol=0)


def test_clear_one_line_errors(tiny_config, tmp_path, capsys):
    bad_inductor = tmp_path / "bad_inductor.toml"
    bad_inductor.write_text(TINY_TOML + '[compile]\ninductor = ["combo_kernel=true"]\n')
    cases = [
        (["--config", str(tmp_path / "missing.toml")], "no such file"),
        (["--config", str(tiny_config), "--block", "conv"], "unknown block"),
        (["--config", str(tiny_config), "--passes", "fuse_all"],
         "--passes: unknown pass 'fuse_all'; allowed: situ_glu, attn_res, kda_gate"),
        (["--config", str(bad_inductor)],
         "compile.inductor: 'combo_kernel=true': give KEY=VALUE with KEY an option of "
         "torch._inductor.config"),
        (
            ["--config", str(tiny_config), "--device", f"cuda:{torch.cuda.device_count() + 7}"],
            "cuda",
        ),
    ]
    for argv, expected in cases:
        assert main(argv + ["--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and expected in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()
