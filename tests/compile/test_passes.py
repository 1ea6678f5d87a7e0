"""Each Inductor pass fires (matched count > 0) and keeps compiled results equal to eager."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from compile_passes import registry
from compile_passes.inspect import inspect_compile
from compile_passes.registry import FusionPasses, matched_counts
from tests.metrics import rel_max
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.norm import RMSNorm
from titan_moe.model.situ_glu import situ_glu
from titan_moe.ops.situ_glu import situ_glu_packed

RTOL = 1e-5  # fp32 compiled vs eager, relative to each tensor's largest magnitude
# The AttnRes tests run with scalar C++ kernels (tests/scalar_cpp.py); the SiTU-GLU tests, which
# count the generated kernels, keep the default.


class _SiTUGLU(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return situ_glu(a, b)


def _compiled_vs_eager(module: nn.Module, inputs: list[torch.Tensor], passes: list[str]):
    result = inspect_compile(module, (inputs,) if isinstance(module, AttnResSite) else
                             tuple(inputs), steps=1, passes=passes)
    compiled = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    out = module(inputs) if isinstance(module, AttnResSite) else module(*inputs)
    out.square().mean().backward()
    return result, compiled, [x.grad for x in inputs]


def test_situ_glu_pass_fires_and_keeps_one_kernel_each_way():
    a, b = (torch.randn(8, 16, requires_grad=True) * 4 for _ in range(2))
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    result, compiled, eager = _compiled_vs_eager(_SiTUGLU(), [a, b], ["situ_glu"])
    assert matched_counts()["situ_glu"] == 1
    for unit in ("graph0_forward", "graph0_backward"):
        generated = [k for k in result.kernels if k.unit == unit and k.kind == "generated"]
        assert len(generated) == 1, generated
        assert "compile_passes.situ_glu" in result.post_grad[unit]
    for c, e in zip(compiled, eager, strict=True):
        assert rel_max(c, e) < RTOL


class _PackedSiTUGLU(nn.Module):
    def forward(self, ab: torch.Tensor) -> torch.Tensor:
        return situ_glu_packed(ab)


def test_situ_glu_pass_fires_on_the_packed_form_and_keeps_one_kernel_each_way():
    """The experts' and FFNs' w13 layout, ab = [a | b]: the pass matches through the chunk, and
    the backward's [∂a | ∂b] is one kernel (tests/gpu/test_situ_glu_cuda.py checks its loads on
    CUDA, where Inductor's cat lowering decides otherwise than on the CPU)."""
    ab = (torch.randn(8, 32) * 4).requires_grad_()
    result, compiled, eager = _compiled_vs_eager(_PackedSiTUGLU(), [ab], ["situ_glu"])
    assert matched_counts()["situ_glu"] == 1
    for unit in ("graph0_forward", "graph0_backward"):
        generated = [k for k in result.kernels if k.unit == unit and k.kind == "generated"]
        assert len(generated) == 1, generated
    assert rel_max(compiled[0], eager[0]) < RTOL


# (site parameters' dtype, sources' dtypes): fp32 alone; the training layout under bf16 autocast
# (an fp32 site, the embedding's fp32 block beside a bf16 partial sum); a model cast whole to bf16.
SITE_LAYOUTS = {
    "fp32": (torch.float32, [torch.float32] * 3),
    "autocast": (torch.float32, [torch.float32, torch.bfloat16]),
    "bf16": (torch.bfloat16, [torch.bfloat16] * 3),
}


@pytest.mark.parametrize("layout", SITE_LAYOUTS)
@scalar_cpp()
def test_attn_res_pass_fires_and_preserves_gradients(layout):
    param_dtype, dtypes = SITE_LAYOUTS[layout]
    site = AttnResSite(16).to(param_dtype)
    with torch.no_grad():
        site.query.normal_()
    sources = [torch.randn(2, 4, 16, dtype=d, requires_grad=True) for d in dtypes]
    result, compiled, eager = _compiled_vs_eager(site, sources, ["attn_res"])
    assert matched_counts()["attn_res"] == 1
    assert "aten.mv" not in result.post_grad["graph0_forward"]
    for c, e in zip(compiled, eager, strict=True):
        # Gradients of bf16 sources are rounded to bf16 at the end: one rounding apart.
        assert rel_max(c, e) < (RTOL if c.dtype == torch.float32 else 1e-2)


@scalar_cpp()
def test_attn_res_pass_compiles_dynamic_shapes_and_matches_eager():
    """Under dynamic shapes the site's stacked sources have SymInt sizes, which do not hash: the
    pass's signature scan crashed the compile ("unhashable type: non-nested SymInt"). Its
    patterns are traced at static shapes, so the graph compiles unfused; results stay eager's."""
    site = AttnResSite(16)
    with torch.no_grad():
        site.query.normal_()
    sources = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(3)]
    compiled = torch.compile(site, fullgraph=True, dynamic=True,
                             options=registry.inductor_options(["attn_res"]))
    out = compiled(sources)
    out.square().mean().backward()
    grads = [x.grad.clone() for x in sources]
    for x in sources:
        x.grad = None
    want = site(sources)
    want.square().mean().backward()
    assert rel_max(out, want) < RTOL
    for got, ref in zip(grads, (x.grad for x in sources), strict=True):
        assert rel_max(got, ref) < RTOL


CONVERT = torch.ops.prims.convert_element_type.default


def _noop_conversions_after_permutes(graph: torch.fx.Graph) -> None:
    """What CUDA autocast left around the backward of the site's fp32 score product (the H200,
    torch 2.11: Inductor's joint-graph patterns rewrite it as conversions to fp32 around a mul
    and a sum); on CPU that product has none."""
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.permute.default:
            with graph.inserting_after(node):
                convert = graph.call_function(CONVERT, (node, node.meta["val"].dtype))
            convert.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(convert, delete_user_cb=lambda u, c=convert: u is not c)


def _fold_bf16_round_trips(graph: torch.fx.Graph) -> None:
    """convert(convert(x, bf16), fp32) of an fp32 x read as x: what Inductor did on CUDA to a
    bf16 site's cast back to bf16 and the next RMSNorm's cast up (the H200, torch 2.11)."""
    for node in list(graph.nodes):
        inner = node.args[0] if node.target is CONVERT else None
        if (isinstance(inner, torch.fx.Node) and node.args[1] == torch.float32
                and inner.target is CONVERT and inner.args[1] == torch.bfloat16
                and inner.args[0].meta["val"].dtype == torch.float32):
            node.replace_all_uses_with(inner.args[0])
    graph.eliminate_dead_code()


class _CudaRewriteThenPasses(CustomGraphPass):
    """The joint graph as it reached our passes on CUDA, reproduced on CPU, then the passes."""

    def __init__(self, rewrite) -> None:
        self.rewrite = rewrite

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.rewrite(graph)
        FusionPasses(["attn_res"])(graph)

    def uuid(self) -> None:
        return None  # never cached


class _SiteThenNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.site, self.norm = AttnResSite(dim), RMSNorm(dim)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return self.norm(self.site(sources))


# name -> (rewrite, dtype of the module and sources, tolerance of the gradients against eager)
CUDA_REWRITES = {
    "noop_conversions": (_noop_conversions_after_permutes, torch.float32, RTOL),
    # The fold skips eager's bf16 rounding of the site's output: a few bf16 roundings apart.
    "bf16_round_trip": (_fold_bf16_round_trips, torch.bfloat16, 3e-2),
}


@pytest.mark.parametrize("rewrite", CUDA_REWRITES)
@scalar_cpp()
def test_attn_res_pass_matches_the_cuda_graph(rewrite):
    rewrite_fn, dtype, tol = CUDA_REWRITES[rewrite]
    torch.manual_seed(0)
    module = _SiteThenNorm(16).to(dtype)
    with torch.no_grad():
        module.site.query.normal_()
    sources = [torch.randn(2, 4, 16, dtype=dtype, requires_grad=True) for _ in range(3)]
    got, matched = _compiled_grads(module, sources, _CudaRewriteThenPasses(rewrite_fn))
    assert matched == 1
    _loss(module(sources)).backward()
    for c, e in zip(got, [x.grad for x in sources], strict=True):
        assert rel_max(c, e) < tol


@scalar_cpp()
def test_noop_conversions_alone_stop_the_match(monkeypatch):
    """The control of the test above: without dropping them, the same graph matches nothing."""
    monkeypatch.setattr(registry, "drop_noop_conversions", lambda graph: 0)
    module = _SiteThenNorm(16)
    sources = [torch.randn(2, 4, 16, requires_grad=True) for _ in range(3)]
    rewrite = _CudaRewriteThenPasses(_noop_conversions_after_permutes)
    assert _compiled_grads(module, sources, rewrite)[1] == 0


def _compiled_grads(module: nn.Module, sources: list[torch.Tensor], post_pass: CustomGraphPass):
    """(the sources' gradients of a compiled step, attn_res matches), the gradients cleared."""
    torch._dynamo.reset()
    counters[registry.COUNTER].clear()
    compiled = torch.compile(module, fullgraph=True, options={"joint_custom_post_pass": post_pass})
    _loss(compiled(sources)).backward()
    got = [x.grad.clone() for x in sources]
    for x in sources:
        x.grad = None
    return got, matched_counts()["attn_res"]


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A fixed random projection: mean(out²) of an RMSNorm's output is constant up to eps, its
    gradient all but zero."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return (out.float() * weight).sum()


def test_pass_cache_key_covers_the_model_code_the_patterns_are_traced_from():
    names = {path.relative_to(Path(registry.__file__).parents[1]).as_posix()
             for path in registry.pass_sources(registry.PASS_NAMES)}
    assert names >= {"compile_passes/registry.py", "compile_passes/attn_res_fusion.py",
                     "titan_moe/model/attn_res.py", "titan_moe/ops/attn_res/naive.py",
                     "titan_moe/ops/situ_glu/naive.py", "titan_moe/ops/kda/gate.py"}, names


def test_kda_gate_replacement_equals_the_gate_cumsum_in_float64():
    from compile_passes.kda_gate_cumsum_fusion import _search, gate_chunk_cumsum

    g_raw = torch.randn(2, 128, 2, 16, dtype=torch.float64)
    A_log, dt_bias = torch.randn(2, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    want = _search(g_raw, A_log, dt_bias, -5.0)
    got = gate_chunk_cumsum(g_raw, A_log, dt_bias, -5.0)
    assert rel_max(got, want) < 1e-12  # float64: only summation order differs


def test_unknown_pass_name_is_a_clear_error():
    from titan_moe.parallel.parallelize import apply_compile

    with pytest.raises(ValueError, match="compile.passes: unknown pass 'fuse_all'; allowed"):
        apply_compile(nn.Module(), "inductor", set(), passes=["fuse_all"])
