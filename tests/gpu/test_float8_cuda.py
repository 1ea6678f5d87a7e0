"""float8 training on Hopper (torchao 0.18): the routed experts' float8 grouped GEMM against the
bf16 one, and a compiled training step of the debug model with `[float8] enable` and `moe`.

Errors are SQNR, 20 log10(||want|| / ||got - want||) in dB. The bounds for one expert layer are
torchao's own for rowwise float8 MoE training with 16-row groups (its moe_training tests): 29 dB
for the output and the input's gradient, 23 dB for each weight's gradient.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from float8 import convert_dense_linears, convert_routed_experts
from float8.grouped import TOKEN_GROUP_ALIGNMENT
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.model.moe import GroupedExperts
from titan_moe.parallel.parallelize import apply_compile
from titan_moe.train.config import Float8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper GPU (float8 grouped GEMM)",
    ),
]

OUT_SQNR, INPUT_GRAD_SQNR, WEIGHT_GRAD_SQNR = 29.0, 29.0, 23.0
# A whole model's step: eight layers of float8 GEMMs compound, and a token whose top-k scores
# nearly tie can switch experts, so the model's gradient gets a looser bound than one layer's.
MODEL_GRAD_SQNR = 20.0
LOSS_RTOL = 1e-2


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return 20 * math.log10(want.norm() / (got - want).norm().clamp_min(1e-30))


class Experts(nn.Module):
    """A holder like the MoE layer: convert_routed_experts finds `experts` by attribute."""

    def __init__(self, experts: GroupedExperts):
        super().__init__()
        self.experts = experts
        self.group_align = 1


def test_float8_grouped_gemm_with_16_row_groups_matches_bf16():
    """The proxy's expert shapes (latent 1024, hidden 768); group sizes multiples of 16 as our
    dispatch pads them, one of them empty; forward and backward."""
    torch.manual_seed(0)
    n_experts, dim, hidden = 8, 1024, 768
    sizes = TOKEN_GROUP_ALIGNMENT * torch.tensor([3, 0, 16, 1, 9, 1, 32, 5])
    offs = sizes.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(int(sizes.sum()), dim, device="cuda", dtype=torch.bfloat16)
    reference = GroupedExperts(n_experts, dim, hidden).cuda()
    reference.init_weights(0.02, 0.02)
    holder = Experts(GroupedExperts(n_experts, dim, hidden).cuda())
    holder.experts.load_state_dict(reference.state_dict())
    assert convert_routed_experts(holder, Float8(moe=True)) == ["experts"]
    assert holder.group_align == TOKEN_GROUP_ALIGNMENT
    results = []
    for module in (reference, holder.experts):
        xi = x.clone().requires_grad_()
        out = module(xi, offs)
        out.float().square().mean().backward()
        results.append((out, xi.grad, *(w.grad for w in (module.w1, module.w3, module.w2))))
    (out, dx, *dws), (out8, dx8, *dws8) = results
    assert sqnr(out8, out) >= OUT_SQNR, sqnr(out8, out)
    assert sqnr(dx8, dx) >= INPUT_GRAD_SQNR, sqnr(dx8, dx)
    for name, got, want in zip(("w1", "w3", "w2"), dws8, dws, strict=True):
        assert sqnr(got, want) >= WEIGHT_GRAD_SQNR, (name, sqnr(got, want))


def _step(model: nn.Module, params: dict[str, nn.Parameter], tokens: torch.Tensor,
          doc_ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One training step as the trainer runs it on one GPU: fp32 parameters under bf16
    autocast, fused AdamW. Returns the loss and the gradients, by the names of `params` (taken
    before compile, which renames parameters)."""
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3, fused=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1], doc_ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in params.items() if p.grad is not None}
    optimizer.step()
    return loss.item(), grads


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "dense+moe"])
def test_float8_compiled_training_step_of_the_debug_model(moe):
    """`[float8] enable = true` (rowwise, the size filter at 128 so the debug model's 256-wide
    linears convert), with and without `moe = true`, compiled as training compiles it, against
    the bf16 step eager: the step runs, its loss and gradient stay close, the weights move."""
    torch._dynamo.reset()
    args = get_flavor("debug")
    tokens = torch.randint(0, args.vocab_size, (2, 513), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    doc_ids = torch.cat([torch.zeros(2, 200), torch.ones(2, 312)], 1).int().cuda()
    runs = []
    for float8 in (False, True):
        torch.manual_seed(0)
        model = TitanMoE(args).cuda()
        model.init_weights()
        if float8:
            cfg = Float8(enable=True, moe=moe, recipe="rowwise", filter_min_size=128)
            assert convert_dense_linears(model, cfg)
            if moe:
                assert convert_routed_experts(model, cfg)
        params = dict(model.named_parameters())
        before = {n: p.detach().float().clone() for n, p in params.items()}
        if float8:
            apply_compile(model, "inductor", set())
        loss, grads = _step(model, params, tokens, doc_ids)
        moved = {n for n, p in params.items() if not torch.equal(p.detach().float(), before[n])}
        runs.append((loss, grads, moved))
    (loss, grads, _), (loss8, grads8, moved8) = runs
    assert math.isfinite(loss8) and abs(loss8 - loss) <= LOSS_RTOL * loss, (loss8, loss)
    assert sorted(grads8) == sorted(grads)
    want = torch.cat([grads[n].flatten() for n in sorted(grads)])
    got = torch.cat([grads8[n].flatten() for n in sorted(grads)])
    assert sqnr(got, want) >= MODEL_GRAD_SQNR, sqnr(got, want)
    assert moved8 == set(grads8)
