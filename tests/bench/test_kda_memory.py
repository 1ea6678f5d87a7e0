"""bench/kda_memory.py: our KDA op's predicted forward+backward peak against the buffers counted
by hand.

The hand count is the op's memory contract: the backward peaks while the state terms are
computed, with the five fp32 [T, H, K] buffers (G, K_d and three gradients), the two
[T, H, 64] chunk matrices (KK, Tinv), the states and their gradients, Ṽ and dṼ live, besides
what bench/kda.py holds (inputs, dO, the output, the inputs' .grad). A buffer added to that
peak, or one freed later than it was, fails this test."""

import pytest

from tests.bench_scripts import BENCH, load_bench


@pytest.fixture
def kda_memory(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    return load_bench("kda_memory")


@pytest.mark.parametrize("fused", [False, True], ids=["g-given", "fused-gate"])
def test_our_op_peak_equals_the_hand_count(kda_memory, fused):
    b, t, h, d = 1, 128, 1, 128
    n_chunks, chunk = 2, 64
    bf16_btd = b * t * h * d * 2
    held = (4 * bf16_btd + b * t * h * 2) * 2 + 2 * bf16_btd  # inputs and .grad; dO, o
    if fused:
        held += (h + h * d) * 4 * 2  # A_log, dt_bias and their .grad
    fp32_btk = b * t * h * d * 4
    peak = (5 * fp32_btk  # G, K_d, d_qg, d_w, d_kd
            + 2 * b * t * h * chunk * 4  # KK, Tinv
            + 2 * b * n_chunks * h * d * d * 4  # states, their gradients
            + 2 * fp32_btk  # Ṽ, dṼ
            + b * n_chunks * h * d * 4)  # d_gamma
    assert kda_memory.predicted_peak(kda_memory.ours, (b, t, h, d), fused) == held + peak
