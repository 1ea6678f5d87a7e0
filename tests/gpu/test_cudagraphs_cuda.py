"""CUDA graphs for the compiled step (`compile.cudagraphs`): fla's static document layout equals
its exact one, and a CUDA-graphed model trains like the compiled one while the documents change
from step to step (a replay must not keep the recorded batch's layout)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.gpu.bf16_tolerance import BF16_RTOL
from tests.gpu.test_kda_triton_cuda import G_MIN, GRAD_RMS, make_case, needs_fla
from tests.metrics import rel_rms
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.ops.kda import chunk_kda_fla
from titan_moe.parallel.parallelize import apply_compile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    needs_fla,
]


def doc_ids_from_starts(batch: int, seq_len: int, starts: list[list[int]]) -> torch.Tensor:
    doc = torch.zeros(batch, seq_len, dtype=torch.int32)
    for row, row_starts in enumerate(starts):
        for s in row_starts:
            doc[row, s:] += 1
    return doc.cuda()


# Documents of 1, 5 and 63 tokens, a boundary on a chunk edge, rows of one document.
LAYOUTS = {
    "short-docs": [[1, 6, 69, 128, 200], [300]],
    "one-doc-a-row": [[], []],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fla_static_layout_matches_exact_layout(layout):
    q, k, v, g, beta, h0, A_log, dt_bias = make_case(2, 450, 16, 128, "fused")
    doc = doc_ids_from_starts(2, 450, LAYOUTS[layout])
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v, g, beta)]
    leaves += [h0.requires_grad_(), A_log.requires_grad_(), dt_bias.requires_grad_()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(q.shape, device="cuda", generator=gen)
    ds = torch.randn(h0.shape, device="cuda", generator=gen)

    def run(static_layout: bool):
        o, s = chunk_kda_fla(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                             doc=doc, A_log=leaves[6], dt_bias=leaves[7], g_min=G_MIN,
                             static_layout=static_layout)
        loss = (o.float() * do).sum() + (s * ds).sum()
        return [o, s, *torch.autograd.grad(loss, leaves)]

    exact, static = run(False), run(True)
    for i, (got, want) in enumerate(zip(static, exact, strict=True)):
        assert rel_rms(got, want) <= (1e-3 if i < 2 else GRAD_RMS / 10), i


def text_batches(vocab: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Same shapes every step, documents that move: each replay must see its own layout."""
    gen = torch.Generator().manual_seed(0)
    starts = [[[40], [100]], [[3, 9, 130], []], [[], [64, 65, 200]]]
    return [(torch.randint(0, vocab, (2, 256), generator=gen).cuda(),
             doc_ids_from_starts(2, 256, starts[i % len(starts)])) for i in range(steps)]


def train(model: TitanMoE, batches, graphed: bool) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for tokens, doc_ids in batches:
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, doc_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_cudagraphed_debug_model_trains_like_eager_with_moving_documents():
    """Six AdamW steps, documents changing every step: the graphed model's losses follow the
    eager model's (exact layouts, host-read), no region is skipped, and the step launches CUDA
    graphs. (Eager, not compiled, is the reference: one compile of the model instead of two.)"""
    torch.manual_seed(0)
    model = TitanMoE(get_flavor("debug")).cuda()
    model.init_weights()
    graphed = copy.deepcopy(model)
    batches = text_batches(model.args.vocab_size, 6)
    want = train(model, batches, graphed=False)
    torch._dynamo.reset()
    counters["inductor"].clear()
    apply_compile(graphed, "inductor", set(), cudagraphs=True)
    got = train(graphed, batches, graphed=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= BF16_RTOL * abs(b), (step, got, want)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(graphed, batches[:1], graphed=True)
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
    assert launches > 0
