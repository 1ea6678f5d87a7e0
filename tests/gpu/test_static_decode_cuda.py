"""The compiled, CUDA-graphed decode step on the GPU (`pytest -m gpu`), debug flavor in bf16.

Reference: the same static step run eagerly, and the dynamic-cache Session (SDPA over expanded
MLA keys, no preallocated buffer), both bf16, teacher-forced with the same tokens; tolerance
BF16_RTOL of the largest logit. The step must compile once, be CUDA-graphed (no cudagraph skip)
and not synchronise with the host (torch.cuda.set_sync_debug_mode("error") around the steps).
"""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.gpu.bf16_tolerance import BF16_RTOL
from tests.metrics import rel_max
from titan_moe.model.args import get_flavor
from titan_moe.model.mla import GatedMLA
from titan_moe.model.model import TitanMoE
from titan_moe.serve.generate import Session
from titan_moe.serve.static_decode import StaticSession

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model() -> TitanMoE:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TitanMoE(get_flavor("debug"))
        model.init_weights()
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def test_cudagraph_step_matches_eager_compiles_once_and_never_syncs():
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()
               for n in (100, 300)]
    torch._dynamo.reset()
    counters.clear()
    steps = 24
    graphed = StaticSession(model, 2, 512, prefill_chunk=128)  # mode auto: reduce-overhead
    assert graphed.mode == "reduce-overhead"
    eager = StaticSession(model, 2, 512, prefill_chunk=128, compile=False)
    dynamic = Session(model, 2, prefill_chunk=128)
    for s in (graphed, eager, dynamic):
        s.extend(prompts)
    running = torch.ones(2, dtype=torch.bool, device="cuda")
    token = graphed.last_logits.argmax(-1)
    worst = 0.0
    for i in range(steps):
        if i == 4:  # warmed up and captured: from here on, any host sync raises
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed.step_logits(token, running).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = eager.step_logits(token, running)
        worst = max(worst, rel_max(got, want))
        dyn = dynamic.model(token[:, None], cache=dynamic.cache, valid=running[:, None])[:, -1]
        worst = max(worst, rel_max(got, dyn.float()))
        token = got.argmax(-1)
    assert worst < BF16_RTOL, worst
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,slots,pos", [(1, 131144, 131100), (8, 4096, 1000)])
def test_mla_decode_op_matches_float64_reference_on_cuda(dtype, batch, slots, pos):
    """The split-KV op at the proxy's widths (16 heads, lora 256, rope 64) against the float64
    reference on the same (rounded) inputs: 1e-5 (fp32) or BF16_RTOL (bf16: p is rounded to
    bf16 before the value product, as in the reference's bf16 path)."""
    from titan_moe.ops.mla_decode import mla_decode_attention_naive, mla_decode_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 16, 320, device="cuda", generator=g).to(dtype)
    kv = torch.randn(batch, slots, 320, device="cuda", generator=g).to(dtype)
    valid = torch.rand(batch, slots, device="cuda", generator=g) > 0.2
    valid[:, pos + 1 :] = False
    p = torch.tensor(pos, device="cuda")
    got = mla_decode_triton(q, kv, valid, p, 320**-0.5, 256)
    want = mla_decode_attention_naive(q.double(), kv.double(), valid, p, 320**-0.5, 256)
    assert rel_max(got, want) < (1e-5 if dtype == torch.float32 else BF16_RTOL)


def test_mla_decode_op_opcheck_on_cuda():
    """Schema, fake implementation and AOT tracing of titan_moe::mla_decode (torch.compile's
    view of the op), on CUDA where the kernel compiles."""
    from titan_moe.ops.mla_decode import mla_decode_triton

    q = torch.randn(2, 16, 320, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 1000, 320, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
    p = torch.tensor(999, device="cuda")
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    report = torch.library.opcheck(mla_decode_triton, (q, kv, valid, p, 0.05, 256),
                                   test_utils=tests)
    assert set(report.values()) == {"SUCCESS"}, report


@torch.no_grad()
def test_sessions_of_two_lengths_share_one_compile_on_cuda():
    """Two CUDA-graphed sessions of batch 2 with 512 and 20,000 slots compile the step once and
    each capture its own CUDA graph (no cudagraph skip); each matches its eager twin within
    BF16_RTOL, teacher-forced with the graphed session's greedy tokens. The two lengths take
    different split layouts of the MLA op (on an H100 or H200, 64 and 128 slots a split: more
    than 4 x SMs / 2 blocks of 64 slots a row at 20,000), which compiled the step twice while the
    split length was a constexpr and the layout's min/max guarded on the slot count."""
    model = _model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()
               for n in (90, 250)]
    torch._dynamo.reset()
    counters.clear()
    running = torch.ones(2, dtype=torch.bool, device="cuda")
    worst = 0.0
    for max_len in (512, 20000):
        graphed = StaticSession(model, 2, max_len, prefill_chunk=128)
        eager = StaticSession(model, 2, max_len, prefill_chunk=128, compile=False)
        for s in (graphed, eager):
            s.extend(prompts)
        token = graphed.last_logits.argmax(-1)
        for _ in range(8):
            got = graphed.step_logits(token, running).clone()
            worst = max(worst, rel_max(got, eager.step_logits(token, running)))
            token = got.argmax(-1)
    assert worst < BF16_RTOL, worst
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@torch.no_grad()
def test_dense_prefill_through_flash_matches_the_full_forward_on_cuda(monkeypatch):
    """Equal rows prefill in the up-projected form (Flash Attention's varlen kernels, key
    segments of 128 slots: 256-token chunks over 1,000 tokens see up to 6 earlier segments);
    every prompt position's logits within BF16_RTOL of the full forward on each row alone
    (the training path: whole-sequence SDPA over expanded keys), bf16."""
    monkeypatch.setattr(GatedMLA, "prefill_key_segment", 128)
    model = _model()
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, model.args.vocab_size, (2, 1000), generator=g)
    session = StaticSession(model, 2, 1024, prefill_chunk=256, compile=False)
    chunks = []
    for start in range(0, 1000, 256):
        session.extend(prompts[:, start:start + 256].tolist())
        chunks.append(session.last_logits.clone())
    want = model(prompts.cuda()).float()
    ends = [min(start + 256, 1000) - 1 for start in range(0, 1000, 256)]
    worst = max(rel_max(got, want[:, end]) for got, end in zip(chunks, ends, strict=True))
    assert worst < BF16_RTOL, worst
