"""What an op allocates while it runs, counted with its launches skipped: the live-bytes count
against a hand-made sequence of allocations, and the KDA op's kept buffers and backward
workspace against its buffers counted by hand."""

import pytest
import torch

from titan_moe.plan.op_workspace import (
    LiveBytes,
    chunk_triton,
    kda_backward_workspace,
    kda_kept_buffers,
)


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


def state_terms_buffers(t: int, k: int) -> int:
    """What the KDA backward that recomputes allocates itself and holds while it computes the
    state terms, its peak (H 1, K = V = k, t tokens in chunks of 64): four fp32 [T, H, K]
    buffers (G and the gradients of Q_g, W and K_d; W and K_d themselves are let go after the
    reverse scan), KK and Tinv ([T, H, 64]), the states and their gradients, Ṽ (bf16, a GEMM
    operand only) and dṼ, d_gamma."""
    chunks = t // 64
    return (4 * t * k * 4 + 2 * t * 64 * 4 + 2 * chunks * k * k * 4 + t * k * 2 + t * k * 4
            + chunks * k * 4)


def kept_bytes(t: int, k: int) -> int:
    """What the forward keeps for the backward (H 1, K = V = k, bf16 inputs): A_qk, KK, Tinv
    (fp32 [T, H, 64]), G (fp32 [T, H, K]), W and K_d (bf16 [T, H, K]), the chunk-entry states
    (fp32 [T/64, H, K, V]) and Ṽ (bf16 [T, H, V])."""
    return 3 * t * 64 * 4 + t * k * 4 + 2 * t * k * 2 + t // 64 * k * k * 4 + t * k * 2


def test_kda_op_keeps_its_buffers_for_the_backward():
    # 3,072 B a token and head at K = V = 128: 768 the chunk matrices, 512 G, 256 each W, K_d,
    # Ṽ, 1,024 the states (64 KiB a chunk).
    t, k = 128, 128
    kept = kda_kept_buffers(1, t, 1, k, k)
    assert [x.dtype for x in kept] == [torch.float32] * 4 + [torch.bfloat16] * 2 + [
        torch.float32, torch.bfloat16]
    assert sum(x.untyped_storage().nbytes() for x in kept) == kept_bytes(t, k) == 3072 * t
    # Whole chunks: 100 tokens keep two chunks' worth; rows and heads multiply.
    assert sum(x.untyped_storage().nbytes() for x in kda_kept_buffers(2, 100, 3, k, k)) == (
        2 * 3 * 3072 * 128)


def test_kda_op_backward_workspace_by_hand():
    # A sequence of one segment: the forward kept its buffers (saved, counted with the layer's
    # saves). The backward peaks at the state terms, holding what the recomputing one holds
    # there (state_terms_buffers): the kept G, KK, Tinv, states and Ṽ among them, A_qk, W and
    # K_d freed with its first op. The workspace is that, and dO, less all it was given.
    t, k = 128, 128
    want = t * k * 2 + state_terms_buffers(t, k) - kept_bytes(t, k)
    assert kda_backward_workspace(1, t, 1, k, k) == want
    assert kda_backward_workspace(1, t, 1, k, k, fused_gate=False) == want
    # Linear in tokens, heads and rows (whole chunks): 2,568 B a token and head, 256 of them dO;
    # with the kept 3,072, 256 below the 5,896 of the backward that held the chunk matrices
    # saved and recomputed the rest (A_qk now goes with the first op).
    assert want == 2568 * t
    assert kda_backward_workspace(2, 4 * t, 3, k, k) == 2 * 4 * 3 * want


@pytest.fixture
def segments_of_128(monkeypatch):
    monkeypatch.setattr(chunk_triton, "SEGMENT", 128)
    kda_backward_workspace.cache_clear()
    yield
    kda_backward_workspace.cache_clear()


def test_kda_op_backward_by_segments_holds_one_segments_buffers(segments_of_128):
    """T 512 in segments of 128: dO and the whole gradients (dq, dk, dv, dg bf16; dbeta fp32),
    the states entering the three later segments, a middle segment's state gradient coming in
    and going out, the fused gate's dA_log and d_dt_bias (fp32, summed over the later
    segments), and one segment's own buffers; four times fewer of those than run whole."""
    t, k, segment, state = 512, 128, 128, 128 * 128 * 4
    held = t * k * 2 + 4 * t * k * 2 + t * 4 + 3 * state + 2 * state + (1 + k) * 4
    assert kda_backward_workspace(1, t, 1, k, k) == held + state_terms_buffers(segment, k)
    assert kda_kept_buffers(1, t, 1, k, k) == ()  # the forward keeps nothing by segments
