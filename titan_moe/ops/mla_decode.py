"""One decode step of absorbed MLA over a preallocated latent cache (split-KV flash decoding).

    q [B, H, C]      the absorbed queries, C = lora + rope (W_ukᵀ q_nope next to q_rope)
    kv [B, S, C]     the latent cache; its first `lora` channels are also the value
    valid [B, S]     written, non-padding slots;  pos: 0-d int64, the query's own slot
    o[b, h] = Σ_s p[b, h, s] kv[b, s, :lora],   p = softmax_s(scale · q·kv_s) over the slots
              s with valid[b, s] or s == pos (a padding query sees its own slot: no empty row)

`mla_decode_attention` is the entry point: on CUDA (fp32/bf16/fp16) the Triton op
`titan_moe::mla_decode`, elsewhere `mla_decode_attention_naive` (two batched GEMMs with fp32
scores). Both read `pos` on the device, so a CUDA-graphed decode step replays them unchanged.

The Triton op reads the cache once: a program takes one row, one block of 16 heads and one
split of the slots, walks its split in BLOCK_S-slot blocks with an online softmax (running max
m, denominator l, fp32 accumulator [heads, lora]); slots past pos were never written and their
loads are masked off, so the unwritten part of the static buffer is never read (the trip count
is fixed, which keeps the loop's loads pipelined). The splits' (m, l, acc) are combined in
PyTorch: o = Σ_i e^{m_i - M} acc_i / Σ_i e^{m_i - M} l_i. The number of splits is fixed by the
batch and heads (about 4 programs an SM), never by pos or the cache length, so the launch is the
same every step.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from titan_moe.ops.fp32_matmul import bmm_fp32

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_S = 64
HEAD_BLOCK = 16  # tl.dot needs 16 rows; fewer heads are masked
PROGRAMS_PER_SM = 4
CPU_PROGRAMS = 8  # the interpreter's "SM count" (tests)


def mla_decode_attention(
    q: Tensor, kv: Tensor, valid: Tensor, pos: Tensor, scale: float, lora: int
) -> Tensor:
    """q [B,H,C], kv [B,S,C], valid [B,S] bool, pos 0-d int64 -> o [B,H,lora] in q's dtype."""
    if q.is_cuda and q.dtype in TRITON_DTYPES and kv.dtype == q.dtype:
        return mla_decode_triton(q, kv, valid, pos, scale, lora).to(q.dtype)
    return mla_decode_attention_naive(q, kv, valid, pos, scale, lora)


def mla_decode_attention_naive(
    q: Tensor, kv: Tensor, valid: Tensor, pos: Tensor, scale: float, lora: int
) -> Tensor:
    """The reference: fp32 scores over every slot, masked, softmax, p (in kv's dtype) @ values."""
    scores = bmm_fp32(q.to(kv.dtype), kv.transpose(1, 2)) * scale  # [B, H, S]
    slot = torch.arange(kv.shape[1], device=kv.device)
    mask = valid | (slot == pos)
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(kv.dtype)
    return torch.bmm(p, kv[..., :lora]).to(q.dtype)


@triton.jit
def attend_slot_block(m, denom, acc, i, start, end, pos, q_l, q_r, kv_row, valid_row, stride_ks,
                      scale, offs_l, offs_r, LORA: tl.constexpr, ROPE: tl.constexpr,
                      BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """(m, denom, acc) after the split's i-th block of BLOCK slots (online softmax); slots at or
    past `end` are masked off and not read."""
    offs_s = start + i * BLOCK + tl.arange(0, BLOCK)
    s_in = offs_s < end
    k_rows = kv_row + offs_s[:, None] * stride_ks
    k_l = tl.load(k_rows + offs_l[None, :], mask=s_in[:, None] & (offs_l[None, :] < LORA),
                  other=0.0)
    k_r = tl.load(k_rows + LORA + offs_r[None, :],
                  mask=s_in[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    scores = tl.dot(q_l, tl.trans(k_l), input_precision=PRECISION)
    scores += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
    ok = tl.load(valid_row + offs_s, mask=s_in, other=0) != 0
    ok = (ok | (offs_s == pos)) & s_in
    scores = tl.where(ok[None, :], scores * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_l.dtype), k_l, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def mla_decode_split_kernel(
    q_ptr, kv_ptr, valid_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
    S, H, scale, stride_qb, stride_qh, stride_kb, stride_ks, stride_vb, SPLIT_LEN,
    LORA: tl.constexpr, ROPE: tl.constexpr, LORA_P: tl.constexpr, ROPE_P: tl.constexpr,
    H_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    # Inductor passes Python floats as fp64 scalars (Triton's launcher: fp32); uncast, the scores
    # and the running max would turn fp64 inside the loop.
    scale = tl.cast(scale, tl.float32)
    b = tl.program_id(0)
    split = tl.program_id(1)
    head_block = tl.program_id(2)
    n_splits = tl.num_programs(1)
    n_head_blocks = tl.num_programs(2)
    offs_h = head_block * H_BLOCK + tl.arange(0, H_BLOCK)
    offs_l = tl.arange(0, LORA_P)
    offs_r = tl.arange(0, ROPE_P)
    h_in = offs_h < H
    q_rows = q_ptr + b * stride_qb + offs_h[:, None] * stride_qh
    q_l = tl.load(q_rows + offs_l[None, :], mask=h_in[:, None] & (offs_l[None, :] < LORA),
                  other=0.0)
    q_r = tl.load(q_rows + LORA + offs_r[None, :], mask=h_in[:, None] & (offs_r[None, :] < ROPE),
                  other=0.0)
    pos = tl.load(pos_ptr)
    start = split * SPLIT_LEN
    # Slots past pos were never written: the split stops there (or never starts).
    end = tl.minimum(tl.minimum(start + SPLIT_LEN, S), pos + 1)
    m = tl.full([H_BLOCK], -1e30, tl.float32)  # finite: a fully masked block leaves m, denom as is
    denom = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, LORA_P], tl.float32)
    kv_row = kv_ptr + b * stride_kb
    valid_row = valid_ptr + b * stride_vb
    # The same trip count for every split; blocks past `end` are fully masked: no memory read.
    # SPLIT_LEN is a runtime argument, so one binary serves every cache length. Compiled, a `for`
    # loop (the pipeliner prefetches the next block's slots); Triton 3.6's interpreter holds
    # scalars as 1-element arrays, which range() cannot take, so interpreted it is a `while`.
    n_blocks = SPLIT_LEN // BLOCK
    if INTERPRETED:
        i = 0
        while i < n_blocks:
            m, denom, acc = attend_slot_block(m, denom, acc, i, start, end, pos, q_l, q_r, kv_row,
                                              valid_row, stride_ks, scale, offs_l, offs_r, LORA,
                                              ROPE, BLOCK, PRECISION)
            i += 1
    else:
        for i in range(0, n_blocks):
            m, denom, acc = attend_slot_block(m, denom, acc, i, start, end, pos, q_l, q_r, kv_row,
                                              valid_row, stride_ks, scale, offs_l, offs_r, LORA,
                                              ROPE, BLOCK, PRECISION)
    row = ((b * n_splits + split) * n_head_blocks + head_block) * H_BLOCK + tl.arange(0, H_BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(l_ptr + row, denom)
    tl.store(acc_ptr + row[:, None] * LORA_P + offs_l[None, :], acc)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_layout(batch: int, heads: int, slots: int, device: torch.device) -> tuple[int, int]:
    """(splits a row, slots a split): about PROGRAMS_PER_SM programs an SM over the grid
    (rows x splits x head blocks), each split a whole number of BLOCK_S blocks, the last ones
    empty where the cache has fewer blocks than splits (such a split writes an empty partial:
    m = -1e30, l = 0, acc = 0, which the combine weighs by 0).

    The split count depends on the batch and heads only, never on `slots`: under torch.compile
    with a dynamic cache length the partials' buffers then have static shapes and only the split
    length, a runtime kernel argument, is an expression of `slots`, so caches of every length
    share one graph. (Symbolic buffer sizes mutated by the kernel and then sliced hit an Inductor
    bug of torch 2.11, pytorch#189271: `KeyError` in Scheduler.compute_ancestors, seen compiling
    the proxy's decode step at batch 1 on the H200.)"""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else CPU_PROGRAMS
    head_blocks = triton.cdiv(heads, HEAD_BLOCK)
    splits = triton.cdiv(PROGRAMS_PER_SM * sms, batch * head_blocks)
    return splits, triton.cdiv(triton.cdiv(slots, BLOCK_S), splits) * BLOCK_S


@triton_op("titan_moe::mla_decode", mutates_args=())
def mla_decode_triton(
    q: Tensor, kv: Tensor, valid: Tensor, pos: Tensor, scale: float, lora: int
) -> Tensor:
    """The split-KV kernel and the combine: o [B, H, lora] fp32 (see the module docstring)."""
    batch, heads, width = q.shape
    slots = kv.shape[1]
    rope = width - lora
    splits, split_len = split_layout(batch, heads, slots, q.device)
    head_blocks = triton.cdiv(heads, HEAD_BLOCK)
    lora_p, rope_p = max(16, triton.next_power_of_2(lora)), max(16, triton.next_power_of_2(rope))
    q = q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    # A copy, not view(torch.uint8): Inductor of torch 2.11 cannot lower a bool dtype view.
    valid = valid.to(torch.uint8) if valid.dtype == torch.bool else valid
    rows = head_blocks * HEAD_BLOCK
    m = q.new_empty(batch, splits, rows, dtype=torch.float32)
    denom = torch.empty_like(m)
    acc = q.new_empty(batch, splits, rows, lora_p, dtype=torch.float32)
    wrap_triton(mla_decode_split_kernel)[(batch, splits, head_blocks)](
        q, kv, valid, pos, m, denom, acc,
        slots, heads, scale, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
        valid.stride(0), split_len,
        LORA=lora, ROPE=rope, LORA_P=lora_p, ROPE_P=rope_p, H_BLOCK=HEAD_BLOCK, BLOCK=BLOCK_S,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=triton.knobs.runtime.interpret, num_warps=4,
    )  # fmt: skip
    m, denom, acc = m[:, :, :heads], denom[:, :, :heads], acc[:, :, :heads, :lora]
    weight = torch.exp(m - m.amax(1, keepdim=True))  # [B, splits, heads]; empty splits give 0
    return (weight.unsqueeze(-1) * acc).sum(1) / (weight * denom).sum(1).unsqueeze(-1)
