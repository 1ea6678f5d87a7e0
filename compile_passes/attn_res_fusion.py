"""Inductor pass: each Block-AttnRes site as one kernel, reading its n ≤ 9 sources once.

The model's site (titan_moe/model/attn_res.py) stacks the sources into [n, B, T, d], takes the
RMS of every key over d, scores the keys against γ ⊙ w with a matmul, softmaxes over the stacked
dim 0 and sums over it again. Inductor lowers that as a stack copy, a reduction over d, a
matrix-vector product and two reductions over dim 0: several kernels on CUDA and the [n, B, T, d]
stack written and read back. The replacement unrolls the sources instead:

    score_i = rsqrt(mean_d(V_i²) + eps) · Σ_d V_i (γ ⊙ w)        (= <key_i, γ ⊙ w>)
    p = softmax over the n scores (an elementwise max / exp / sum chain)
    out = Σ_i p_i V_i

so every reduction runs over d with the same ranges, and the scheduler fuses the 2n row
reductions and the weighted sum into one persistent-reduction kernel (the backward into one
row kernel plus the column reduction for γ and w). The patterns are traced from the model's
own `attn_res_mix` (the site without its final cast back to the sources' dtype, which Inductor
folds away on CUDA when an RMSNorm follows) for each source count and dtype a graph actually
contains (found from its `cat` nodes), the first time that graph is compiled.

On CUDA the model's sites call the Triton op (titan_moe/ops/attn_res), which already reads each
source once: such a graph has no stacked site and this pass matches nothing there. It still
fuses the PyTorch reference, which CPU graphs (and float64 or n > 9 sites) use.
"""

import inspect

import torch
from torch import Tensor
from torch._inductor.pattern_matcher import (
    PatternMatcherPass,
    fwd_only,
    joint_fwd_bwd,
    register_replacement,
)

from titan_moe.model.attn_res import attn_res_mix

NAME = "attn_res"
MAX_SOURCES = 9
EPS = 1e-6  # the traced pattern's eps, captured as a match argument


def attn_res_unrolled(sources: list[Tensor], query: Tensor, gain: Tensor, eps: float) -> Tensor:
    """attn_res_mix with the sources kept apart (the replacement, in plain PyTorch)."""
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    weight = (gain * query).to(dtype)
    values = [s.to(dtype) for s in sources]
    scores = [
        (v * weight).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps) for v in values
    ]
    top = scores[0]
    for s in scores[1:]:
        top = torch.maximum(top, s)
    exps = [torch.exp(s - top) for s in scores]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    out = (exps[0] / total).unsqueeze(-1) * values[0]
    for e, v in zip(exps[1:], values[1:], strict=True):
        out = out + (e / total).unsqueeze(-1) * v
    return out


def _with_arguments(fn, n: int):
    """fn(list_of_n, query, gain, eps) as a function of n named tensors (what tracing needs)."""
    names = [f"source{i}" for i in range(n)] + ["query", "gain", "eps"]

    def flat(*args):
        return fn(list(args[:n]), *args[n:])

    flat.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    return flat


class _LazyPatterns(PatternMatcherPass):
    """Registers the (source dtypes, training) patterns a graph needs, then matches."""

    def __init__(self) -> None:
        super().__init__(pass_name=f"compile_passes.{NAME}")
        self.registered: set[tuple[tuple[torch.dtype, ...], bool]] = set()

    def apply(self, gm) -> int:
        graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
        training = any(n.op == "placeholder" and "tangents" in n.name for n in graph.nodes)
        for key in _stack_signatures(graph, training) - self.registered:
            self.registered.add(key)
            dtypes, grad = key
            n = len(dtypes)
            # The site's query and gain are fp32 in training (an fp32 island); a model cast
            # whole to the sources' dtype has them in that dtype, a different traced graph.
            for param_dtype in {torch.float32, dtypes[0]}:
                example = [torch.empty(2, 3, 16, dtype=d, requires_grad=grad) for d in dtypes]
                example += [torch.empty(16, dtype=param_dtype, requires_grad=grad)
                            for _ in range(2)]
                register_replacement(
                    _with_arguments(attn_res_mix, n),
                    _with_arguments(attn_res_unrolled, n),
                    example,
                    joint_fwd_bwd if grad else fwd_only,
                    self,
                    scalar_workaround={"eps": EPS},
                )
        return super().apply(gm)


def _stack_signatures(
    graph: torch.fx.Graph, training: bool
) -> set[tuple[tuple[torch.dtype, ...], bool]]:
    """(source dtypes, training) of every `cat` of n ≤ 9 same-shaped floating tensors (a stacked
    site). Under autocast the sources mix dtypes: the embedding's fp32 block beside bf16 partial
    sums of the mixers' outputs."""
    found = set()
    for node in graph.nodes:
        if node.target is not torch.ops.aten.cat.default or not node.args:
            continue
        inputs = node.args[0]
        metas = [getattr(x, "meta", {}).get("val") for x in inputs]
        if not 1 <= len(inputs) <= MAX_SOURCES or any(m is None for m in metas):
            continue
        # Shapes compared by their printed sizes: under dynamic shapes they hold SymInts, which
        # do not hash, and equal symbols print alike without adding a guard.
        shapes = {tuple(str(size) for size in m.shape) for m in metas}
        if len(shapes) == 1 and all(m.dtype.is_floating_point for m in metas):
            found.add((tuple(m.dtype for m in metas), training))
    return found


def pattern_pass() -> PatternMatcherPass:
    return _LazyPatterns()
