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
from tests.gpu.bf16_tolerance import max_relative_error as _rel
from titan_moe.model.args import get_flavor
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
        worst = max(worst, _rel(got, want))
        dyn = dynamic.model(token[:, None], cache=dynamic.cache, valid=running[:, None])[:, -1]
        worst = max(worst, _rel(got, dyn.float()))
        token = got.argmax(-1)
    assert worst < BF16_RTOL, worst
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
