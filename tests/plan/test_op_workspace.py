"""What an op allocates while it runs, counted with its launches skipped: the live-bytes count
against a hand-made sequence of allocations, and the KDA op's kept buffers and backward
workspace and an AttnRes site's backward workspace against their buffers counted by hand."""

import pytest
import torch

from titan_moe.plan.op_workspace import (
    LiveBytes,
    attn_res_backward_workspace,
    attn_res_triton,
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
    state terms (H 1, K = V = k, t tokens in chunks of 64): four fp32 [T, H, K] buffers (G and
    the gradients of Q_g, W and K_d; W and K_d themselves are let go after the reverse scan),
    KK and Tinv ([T, H, 64]), the states and their gradients (bf16, the scans' operand), Ṽ
    (bf16, a GEMM operand only) and dṼ, d_gamma."""
    chunks = t // 64
    return (4 * t * k * 4 + 2 * t * 64 * 4 + chunks * k * k * (2 + 2) + t * k * 2 + t * k * 4
            + chunks * k * 4)


def tile_products_bwd_buffers(t: int, k: int) -> int:
    """What the KDA backward (kept or recomputing) allocates itself and holds while
    tile_products_bwd runs, its peak since the states are stored in bf16 (H 1, K = V = k):
    the state terms' buffers less the states and their gradients (let go after the state
    terms), and ut_transform_bwd's dV (bf16), dbeta (fp32 [T, H]), dA and dP (fp32
    [T, H, 64]), then dQ, dK (bf16), dG (fp32) and the gate's per-tile end terms (fp32
    [T/64, 4, H, K])."""
    chunks = t // 64
    return (state_terms_buffers(t, k) - chunks * k * k * (2 + 2) + t * k * 2 + t * 4
            + 2 * t * 64 * 4 + 2 * t * k * 2 + t * k * 4 + chunks * 4 * k * 4)


def kept_bytes(t: int, k: int) -> int:
    """What the forward keeps for the backward (H 1, K = V = k, bf16 inputs): A_qk, KK, Tinv
    (fp32 [T, H, 64]), G (fp32 [T, H, K]), W and K_d (bf16 [T, H, K]), the chunk-entry states
    (bf16 [T/64, H, K, V]) and Ṽ (bf16 [T, H, V])."""
    return 3 * t * 64 * 4 + t * k * 4 + 2 * t * k * 2 + t // 64 * k * k * 2 + t * k * 2


def test_kda_op_keeps_its_buffers_for_the_backward():
    # 2,560 B a token and head at K = V = 128: 768 the chunk matrices, 512 G, 256 each W, K_d,
    # Ṽ, 512 the states (32 KiB a chunk in bf16; 1,024 and 3,072 in all with fp32 states).
    t, k = 128, 128
    kept = kda_kept_buffers(1, t, 1, k, k)
    assert [x.dtype for x in kept] == [torch.float32] * 4 + [torch.bfloat16] * 4
    assert sum(x.untyped_storage().nbytes() for x in kept) == kept_bytes(t, k) == 2560 * t
    # Whole chunks: 100 tokens keep two chunks' worth; rows and heads multiply.
    assert sum(x.untyped_storage().nbytes() for x in kda_kept_buffers(2, 100, 3, k, k)) == (
        2 * 3 * 2560 * 128)


def test_kda_op_backward_workspace_by_hand():
    # A sequence of one segment: the forward kept its buffers (saved, counted with the layer's
    # saves). The backward peaks while tile_products_bwd runs, holding what the recomputing
    # one holds there (tile_products_bwd_buffers): the kept G, KK, Tinv and Ṽ among them, A_qk,
    # W and K_d freed with its first op, the states with its second. The workspace is that, and
    # dO, less all it was given.
    t, k = 128, 128
    want = t * k * 2 + tile_products_bwd_buffers(t, k) - kept_bytes(t, k)
    assert kda_backward_workspace(1, t, 1, k, k) == want
    assert kda_backward_workspace(1, t, 1, k, k, fused_gate=False) == want
    # Linear in tokens, heads and rows (whole chunks): 2,860 B a token and head, 256 of them dO;
    # with the kept 2,560, 5,420 at the peak. With fp32 states it peaked at the state terms,
    # 5,640 (their 512 B a token more, kept and held there); with the states in bf16 the state
    # terms held 5,128, and with their gradients in bf16 too 4,616.
    assert want == 2860 * t
    assert t * k * 2 + state_terms_buffers(t, k) == 4616 * t
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
    assert kda_backward_workspace(1, t, 1, k, k) == held + tile_products_bwd_buffers(segment, k)
    assert kda_kept_buffers(1, t, 1, k, k) == ()  # the forward keeps nothing by segments


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 9, (torch.float32, torch.bfloat16)])
def test_attn_res_backward_workspace_by_hand(dtypes):
    # n source gradients in their sources' dtypes, returned together, and the gradient of the
    # site's output in the site's dtype (the first source's; read as it comes, no fp32 copy);
    # besides them only [d]-sized fp32 buffers (u, du, and the du partials, one row per
    # backward program): the tolerance.
    rows, dim = 1000, 48
    want = sum(rows * dim * dtype.itemsize for dtype in dtypes) + rows * dim * dtypes[0].itemsize
    small = 4 * dim * (attn_res_triton.CPU_PROGRAMS + 4)
    got = attn_res_backward_workspace(rows, dim, dtypes, dtypes[0])
    assert want <= got <= want + small
