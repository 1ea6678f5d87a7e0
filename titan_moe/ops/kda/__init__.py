"""Kimi Delta Attention ops, laid out like fla's op folders:

    naive.py            the references: the token loop and the chunked form in plain PyTorch
    chunk.py            the entry points chunk_kda / chunk_kda_fused_gate and their CUDA backend
    chunk_triton.py     our Triton op (titan_moe::chunk_kda_fwd/bwd) over the kernels:
      chunk_common.py     what the chunk kernels share: the gate, documents, the GEMM helper
      gate_cumsum.py      G = the gate's cumsum within each chunk, and dg from dG
      tile_products.py    A_qk and KK by 16-row tiles, and their backward into q, k and G
      ut_transform.py     Tinv, W, U (and the keys decayed to the chunk's end), and backward
      state_scan.py       the state carried across chunks, forward and backward, and the
                          gradients through each chunk's use of its states
      chunk_output.py     O = (Gamma Q) S + A_qk V~
    fla_backend.py      fla-core's kernels as custom ops (the "fla" backend)
    recurrent_step.py   one token of the recurrence (decoding)
    gate.py, varlen.py  the lower-bounded gate; documents as cu_seqlens or a [B, T] index
"""

from titan_moe.ops.kda.chunk import (
    CHUNK_SIZE,
    KDA_BACKENDS,
    chunk_kda,
    chunk_kda_fused_gate,
    resolve_backend,
)
from titan_moe.ops.kda.chunk_triton import chunk_kda_triton
from titan_moe.ops.kda.fla_backend import chunk_kda_fla
from titan_moe.ops.kda.gate import kda_gate
from titan_moe.ops.kda.naive import chunk_kda_torch, naive_recurrent_kda
from titan_moe.ops.kda.recurrent_step import recurrent_kda_step

__all__ = ["CHUNK_SIZE", "KDA_BACKENDS", "chunk_kda", "chunk_kda_fla", "chunk_kda_fused_gate",
           "chunk_kda_torch", "chunk_kda_triton", "kda_gate", "naive_recurrent_kda",
           "recurrent_kda_step", "resolve_backend"]
