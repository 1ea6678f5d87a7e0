"""Block Attention Residuals (spec §2): one learned softmax mix over the residual sources.

For sources V_1..V_n ([B, T, d]) at one site with pseudo-query w and gain γ (both [d], fp32):

    key_i   = V_i / sqrt(mean(V_i²) + eps)
    score_i = <key_i, γ ⊙ w>
    p       = softmax_i(score)
    out     = Σ_i p_i V_i            (the raw, un-normalised sources)

w starts at 0, so every site starts as the uniform mean of its sources. All of it runs in fp32
(or wider); the result is cast back to the sources' dtype. The maths lives in
titan_moe/ops/attn_res: a Triton op on CUDA, the PyTorch reference elsewhere.
"""

import torch
import torch.nn as nn

from titan_moe.model.attn_res_sink import sinked_mix
from titan_moe.ops.attn_res import attn_res_mix as ops_attn_res_mix


class AttnResSite(nn.Module):
    """grad_sink: the sources made by `attn_res_sink.sink_block` get their gradients added into
    their sinks (eager only), not returned."""

    def __init__(self, dim: int, eps: float = 1e-6, grad_sink: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.grad_sink = grad_sink
        self.query = nn.Parameter(torch.zeros(dim, dtype=torch.float32))
        self.gain = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if self.grad_sink:
            return sinked_mix(sources, self.query, self.gain, self.eps, sources[0].dtype)
        return attn_res_mix(sources, self.query, self.gain, self.eps, sources[0].dtype)

    def init_weights(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.gain)


class FinalAttnResSite(AttnResSite):
    """The site before the final norm, whose saves stay on the device by reference whatever
    saved-tensor hook encloses the step. Its sources are there already: the finished blocks,
    which the full-AC checkpoints hold by reference until the layers' backward, and the last
    partial sum, which nothing else needs. Under activation offload (save_on_cpu) they were
    copied to the host and brought back as new device tensors for its backward: n more
    [b, T, d] tensors alive next to their n gradients at the loss phase's peak (measured at 256K
    on the proxy: a 20.2 GiB rise for 9 sources of 1 GiB, where 11 GiB is the gradients and
    the fp32 output gradient)."""

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled graph's saves are its own (simple_fsdp)
            return super().forward(sources)
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return super().forward(sources)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def attn_res_mix(
    sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The site's output, computed in fp32 at least (float64 stays float64, for the reference
    tests), never in AMP's bf16, and returned in out_dtype (the site asks for its sources' dtype)
    or, with None, in that compute dtype. On CUDA the Triton op (titan_moe/ops/attn_res), which
    writes out_dtype itself, elsewhere the PyTorch reference
    (`titan_moe.ops.attn_res.attn_res_mix_naive`) and a cast. compile_passes/attn_res_fusion.py
    traces its patterns from this function with out_dtype None (the mix alone) on CPU, i.e. from
    the reference."""
    return ops_attn_res_mix(sources, query, gain, eps, out_dtype)
