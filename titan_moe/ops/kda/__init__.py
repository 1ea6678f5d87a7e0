"""Kimi Delta Attention ops: S_t = S' + beta_t k_t (v_t - S'^T k_t)^T, S' = Diag(exp(g_t)) S_{t-1}.

`chunk_kda` is the training entry point and picks an implementation by device; the plain-PyTorch
chunked form serves every device until a fused kernel registers itself for one.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from titan_moe.ops.kda.chunk import chunk_kda_torch
from titan_moe.ops.kda.gate import kda_gate
from titan_moe.ops.kda.naive import naive_recurrent_kda

__all__ = ["CHUNK_SIZE", "chunk_kda", "chunk_kda_torch", "kda_gate", "naive_recurrent_kda"]

# The training chunk: 64 tokens = four 16-token diagonal tiles (spec §3).
CHUNK_SIZE = 64

# Device type -> chunked implementation; the Triton kernel will register "cuda" here.
CHUNK_KDA_BY_DEVICE: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {}


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA with chunk_kda_torch's signature and semantics (fla layout, scale applied)."""
    impl = CHUNK_KDA_BY_DEVICE.get(q.device.type, chunk_kda_torch)
    # The chunk math is fp32 by design (the gate's exponent range); AMP must not recast it.
    with torch.autocast(q.device.type, enabled=False):
        return impl(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            doc_ids=doc_ids,
            chunk_size=CHUNK_SIZE,
        )
