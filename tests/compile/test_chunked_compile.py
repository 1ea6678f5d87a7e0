"""apply_compile keeps a MoE layer's token chunks bounding its backward: the backward's peak
memory grows with the tokens by their input gradient only, not by every chunk's recompute.

Compiled whole (one Inductor graph with a checkpoint HOP per chunk), the MoE layer's backward
held several chunks' recomputes at once: its peak grew by about 11 fp32 rows of d a token
(d = 256, chunks of 1024 tokens, CPU), where the eager chunk loop's grows by one (the input
gradient, concatenated from the chunks'). Memory is read from the profiler's CPU allocation
events (backward_peak.py).
"""

import torch

from tests.compile.backward_peak import backward_peak
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.parallelize import apply_compile

CHUNK = 512
# Extra tokens may add their input gradient (the chunk's and the concatenation's) and the
# incoming gradient's fp32 rows: 3 rows of d a token. Compiled whole, the MoE layer added
# about 11.
ROWS_PER_TOKEN = 3


def test_compiled_moe_chunks_bound_the_backward():
    args = TitanMoEArgs(
        vocab_size=64, dim=256, n_layers=2, mla_layers=(2,), n_dense_layers=1, n_experts=4,
        top_k=2, moe_token_chunk=CHUNK,
    ).validate()
    torch.manual_seed(0)
    model = TitanMoE(args)
    model.init_weights()
    apply_compile(model, "inductor", set())
    ffn = model.layers["1"].ffn
    with scalar_cpp():
        short, long = (backward_peak(ffn, n * CHUNK, args.dim) for n in (2, 4))
    allowed = ROWS_PER_TOKEN * 4 * args.dim * 2 * CHUNK
    assert long - short <= allowed, (short, long, allowed)
