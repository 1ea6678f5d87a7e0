"""bench/kda_memory.py: our KDA op's predicted forward+backward peak against the buffers counted
by hand.

The hand count is the op's memory contract: the backward peaks while tile_products_bwd runs,
with four fp32 [T, H, K] buffers (G and the gradients of Q_g, W, K_d) and dG, the chunk matrices
KK and Tinv and their gradients dA and dP ([T, H, 64]), Ṽ and dṼ, dV, dQ, dK and dbeta live,
besides what bench/kda.py holds (inputs, dO, the output; the gradients are returned, not
accumulated into .grad). G, KK, Tinv and Ṽ are the forward's, kept for the backward with A_qk,
W and K_d, which its first op last read and frees, and the states (bf16), which its second
frees. A buffer added to that peak, or one
freed later than it was, fails this test."""

import pytest

from tests.bench_scripts import BENCH, load_bench
from tests.plan.test_op_workspace import tile_products_bwd_buffers


@pytest.fixture
def kda_memory(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("kda_memory")


@pytest.mark.parametrize("fused", [False, True], ids=["g-given", "fused-gate"])
def test_our_op_peak_equals_the_hand_count(kda_memory, fused):
    b, t, h, d = 1, 128, 1, 128
    bf16_btd = b * t * h * d * 2
    held = 4 * bf16_btd + b * t * h * 2 + 2 * bf16_btd  # inputs; dO, o
    if fused:
        held += (h + h * d) * 4  # A_log, dt_bias
    peak = held + tile_products_bwd_buffers(t, d)
    assert kda_memory.predicted_peak(kda_memory.ours, (b, t, h, d), fused) == peak
