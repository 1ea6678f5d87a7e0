"""Eager vs torch.compile(fullgraph=True) with our passes on, float32 on CPU: every block type of
the decoder, forward and backward, the whole model, and 20 training steps.

One tiny model holds every block type: layer 0 = KDA mixer + dense SiTU-GLU MLP, layer 1 =
Gated-MLA mixer + LatentMoE, AttnRes sites around both and before the head. It is compiled once,
as one fullgraph (a graph break is an error); forward hooks on the blocks, traced into the graph,
return each block's output from the compiled run. The eager model then trains 20 steps (AdamW +
Quantile Balancing, the trainer's step), and before each the compiled twin takes its weights and
QB biases and runs the same forward and backward: the compiled step is checked at 20 points of a
training run. (Two runs left to themselves drift apart: rounding differences of 1e-7 grow over
the steps until a token whose top-k scores nearly tie takes another expert, and the losses then
differ by 1e-3 and more, with no error in either.)
"""

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_passes.registry import PASS_NAMES, inductor_options, matched_counts
from tests.metrics import rel_max
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.model.quantile_balance import QuantileBalancer

SEQ_LEN, BATCH, STEPS, LR = 64, 2, 20, 3e-3
# Relative to each tensor's largest magnitude. Forward: fp32 reassociation through 2 layers.
FORWARD_RTOL = 1e-4
# Backward reductions run in another order (and the passes rewrite AttnRes and SiTU-GLU's
# backward), so gradients get one decade more.
GRAD_RTOL = 1e-3
# Each step's loss, compiled against eager from the same weights.
LOSS_RTOL = 1e-5

# Block name -> (module path in the model, parameter-name prefixes of that block).
BLOCKS = {
    "kda": ("layers.0.mixer", ("layers.0.mixer.",)),
    "dense_situ_glu": ("layers.0.ffn", ("layers.0.ffn.",)),
    "mla": ("layers.1.mixer", ("layers.1.mixer.",)),
    "moe": ("layers.1.ffn", ("layers.1.ffn.",)),
    "attn_res": ("layers.1.ffn_site", ("layers.0.ffn_site.", "layers.1.mixer_site.",
                                       "layers.1.ffn_site.", "final_site.")),
}


def tiny_args() -> TitanMoEArgs:
    return TitanMoEArgs(
        vocab_size=128, dim=32, n_layers=2, mla_layers=(2,), n_dense_layers=1, dense_hidden=64,
        n_heads=2, head_dim=16, kda_gate_rank=8, mla_n_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=8,
        top_k=2, shared_hidden=16, latent_dim=16, expert_hidden=16, qb_bins=64,
        max_seq_len=SEQ_LEN,
    ).validate()


@dataclass
class Run:
    block_outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # step 1
    logits: torch.Tensor | None = None  # step 1
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # step 1
    losses: list[float] = field(default_factory=list)


def _record_block_outputs(model: nn.Module, sink: dict[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    for block, (path, _) in BLOCKS.items():

        def hook(module, args, out, block=block) -> None:
            sink[block] = out

        modules[path].register_forward_hook(hook)


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _train(eager_model: TitanMoE, compiled_model: TitanMoE, compiled, batch: torch.Tensor,
           doc_ids: torch.Tensor) -> tuple[Run, Run]:
    """STEPS training steps of the eager model; before each, the compiled model takes its weights
    and buffers (QB biases) and runs the same forward and backward. Returns (eager, compiled)."""
    runs = (Run(), Run())
    sinks = ({}, {})
    for model, sink in zip((eager_model, compiled_model), sinks, strict=True):
        _record_block_outputs(model, sink)
    optimizer = torch.optim.AdamW(eager_model.parameters(), lr=LR, weight_decay=0.0,
                                  foreach=False)
    balancer = QuantileBalancer(eager_model)
    for step in range(STEPS):
        with torch.no_grad():  # in place: the compiled graph keeps reading the same tensors
            for twin, source in zip(_state(compiled_model), _state(eager_model), strict=True):
                twin.copy_(source)
        for model, forward, run, sink in zip((eager_model, compiled_model),
                                             (eager_model, compiled), runs, sinks, strict=True):
            sink.clear()  # the hooks' dict looks the same to every compiled call
            logits = forward(batch[:, :-1], doc_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            if step == 0:
                run.logits = logits.detach()
                run.block_outputs = {k: v.detach() for k, v in sink.items()}
                run.grads = {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}
            run.losses.append(loss.item())
        compiled_model.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
    return runs


@pytest.fixture(scope="module")
def runs() -> dict:
    torch.manual_seed(0)
    eager_model = TitanMoE(tiny_args())
    eager_model.init_weights()
    with torch.no_grad():  # non-zero AttnRes queries: a non-uniform mix at every site
        for name, p in eager_model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0, 0.5)
    compiled_model = copy.deepcopy(eager_model)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 128, (BATCH, SEQ_LEN + 1), generator=g)
    doc_ids = torch.tensor([[0] * 20 + [1] * 44, [0] * SEQ_LEN])  # a document starts mid-chunk
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # No cache hits: the pass counters must see this compile.
    with (
        scalar_cpp(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        compiled = torch.compile(compiled_model, fullgraph=True,
                                 options=inductor_options(PASS_NAMES))
        eager_run, compiled_run = _train(eager_model, compiled_model, compiled, batch, doc_ids)
    return {"eager": eager_run, "compiled": compiled_run, "fired": matched_counts(),
            "recompiles": dict(torch._dynamo.utils.counters["stats"])}


def test_every_pass_fired_and_one_graph_served_all_steps(runs):
    assert all(runs["fired"][name] > 0 for name in PASS_NAMES), runs["fired"]
    # fullgraph: one frame compiled, reused by the 19 later steps.
    assert runs["recompiles"].get("unique_graphs", 0) == 1, runs["recompiles"]


def test_whole_model_forward_matches_eager(runs):
    assert rel_max(runs["compiled"].logits, runs["eager"].logits) < FORWARD_RTOL


@pytest.mark.parametrize("block", list(BLOCKS))
def test_block_forward_matches_eager(runs, block):
    eager, compiled = runs["eager"].block_outputs[block], runs["compiled"].block_outputs[block]
    assert compiled.shape == eager.shape
    assert rel_max(compiled, eager) < FORWARD_RTOL


@pytest.mark.parametrize("block", list(BLOCKS))
def test_block_backward_matches_eager(runs, block):
    _, prefixes = BLOCKS[block]
    eager = runs["eager"].grads
    names = [n for n in eager if n.startswith(prefixes)]
    assert names, block
    assert set(runs["compiled"].grads) == set(eager)
    for name in names:
        if eager[name].abs().max() > 0:
            assert rel_max(runs["compiled"].grads[name], eager[name]) < GRAD_RTOL, name


def test_whole_model_backward_matches_eager(runs):
    eager, compiled = runs["eager"].grads, runs["compiled"].grads
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight"):
        assert rel_max(compiled[name], eager[name]) < GRAD_RTOL, name


def test_twenty_training_steps_compiled_match_eager(runs):
    eager, compiled = runs["eager"].losses, runs["compiled"].losses
    assert len(compiled) == STEPS
    assert eager[-1] < eager[0] - 0.5  # the run learns, so the comparison covers real updates
    for step, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert abs(c - e) / e < LOSS_RTOL, (step, c, e)
