"""What an op allocates while it runs, counted with its launches skipped: the live-bytes count
against a hand-made sequence of allocations, and the KDA op's backward workspace against its
buffers counted by hand."""

import torch

from titan_moe.plan.op_workspace import LiveBytes, kda_backward_workspace


def test_live_bytes_by_hand():
    tracker = LiveBytes()
    with tracker:
        a = torch.empty(250)  # 1000 B
        b = torch.empty(750)  # 3000 B
        view = b[10:]  # the same storage: not counted again
        del a
        c = torch.empty(125)  # 500 B
    assert (tracker.peak, tracker.now) == (4000, 3500)
    del b
    assert tracker.now == 3500  # the view keeps b's storage
    del view, c
    assert tracker.now == 0


def test_kda_op_backward_workspace_by_hand():
    """At B 1, T 128, H 1, K = V = 128 (2 chunks of 64) the op's backward peaks while it computes
    the state terms: dO (bf16), five fp32 [T, H, K] buffers (G, K_d and the gradients of Q_g, W
    and K_d), KK and Tinv ([T, H, 64]), the states and their gradients, Ṽ and dṼ, d_gamma."""
    t, k, chunks = 128, 128, 2
    want = (t * k * 2 + 5 * t * k * 4 + 2 * t * 64 * 4 + 2 * chunks * k * k * 4 + 2 * t * k * 4
            + chunks * k * 4)
    assert kda_backward_workspace(1, t, 1, k, k) == want
    assert kda_backward_workspace(1, t, 1, k, k, fused_gate=False) == want
    # Linear in tokens, heads and rows (whole chunks): 4 kB a token and head, 1 of them dO.
    assert kda_backward_workspace(2, 4 * t, 3, k, k) == 2 * 4 * 3 * want
