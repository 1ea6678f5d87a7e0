"""AttnRes gradient sinks (model/attn_res_sink.py): the model with `attn_res_grad_sink` takes the
same gradients as without, in float64 (TOL: the two sum a block's gradient parts in different
orders), with and without full activation checkpointing; a site's backward returns a gradient
for its last source only, the blocks' parts going into their sinks; and a block's sink hands its
sum on only after every site that read the block ran its backward."""

from dataclasses import replace

import pytest
import torch
from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac

from titan_moe.model.args import FLAVORS
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.attn_res_sink import sink_block
from titan_moe.model.model import TitanMoE

TOL = 1e-11


def _grads(sink: bool, ac: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    args = replace(FLAVORS["debug"], n_layers=5, mla_layers=(2, 5), attn_res_block_size=2,
                   attn_res_grad_sink=sink)
    torch.manual_seed(0)
    model = TitanMoE(args).double()
    model.init_weights()
    with torch.no_grad():  # sites away from their uniform init, so every term of dV_i counts
        for name, p in model.named_parameters():
            if name.endswith(("site.query", "site.gain")):
                p.add_(0.3 * torch.randn_like(p))
    if ac:
        apply_ac(model, ActivationCheckpoint(mode="full"))
    tokens = torch.randint(args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "full-ac"])
def test_sinks_give_the_models_gradients(ac):
    loss, grads = _grads(sink=False, ac=ac)
    sink_loss, sink_grads = _grads(sink=True, ac=ac)
    assert torch.equal(sink_loss, loss)
    assert sink_grads.keys() == grads.keys()
    for name, g in grads.items():
        scale = max(1.0, g.abs().max().item())
        assert (sink_grads[name] - g).abs().max().item() <= TOL * scale, name


def test_a_site_returns_only_its_unsinked_sources_gradient_and_fills_the_sinks():
    torch.manual_seed(2)
    site = AttnResSite(8, grad_sink=True).double()
    with torch.no_grad():
        site.query.normal_()
    raw = [torch.randn(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    blocks = [sink_block(raw[0]), sink_block(raw[1])]
    returned = {}
    for i, v in enumerate([*blocks, raw[2]]):
        v.register_hook(lambda g, i=i: returned.update({i: g is not None}))
    upstream = torch.randn(3, 8, dtype=torch.float64)
    (site([*blocks, raw[2]]) * upstream).sum().backward()
    # The reference: the same mix without sinks.
    plain = AttnResSite(8).double()
    plain.load_state_dict(site.state_dict())
    leaves = [x.detach().requires_grad_() for x in raw]
    want = torch.autograd.grad((plain(leaves) * upstream).sum(), leaves)
    # Each hook ran; only the partial sum's saw a gradient: none was returned for the blocks.
    assert returned == {0: False, 1: False, 2: True}
    for got, expected in zip([x.grad for x in raw], want, strict=True):
        assert (got - expected).abs().max().item() <= TOL


def test_a_sink_hands_on_its_sum_after_every_reader():
    # Two sites read one block; the block's producer must see both parts summed, once.
    torch.manual_seed(3)
    sites = [AttnResSite(8, grad_sink=True).double() for _ in range(2)]
    for site in sites:
        with torch.no_grad():
            site.query.normal_()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    calls = []
    producer = x * 1.0
    producer.register_hook(lambda g: calls.append(g.clone()))
    block = sink_block(producer)
    partial = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = sites[0]([block, partial]) + 2 * sites[1]([block, partial * 3])
    out.sum().backward()
    plain = [AttnResSite(8).double() for _ in range(2)]
    for p, s in zip(plain, sites, strict=True):
        p.load_state_dict(s.state_dict())
    xs, ps = x.detach().requires_grad_(), partial.detach().requires_grad_()
    want = torch.autograd.grad((plain[0]([xs * 1.0, ps]) + 2 * plain[1]([xs * 1.0, ps * 3])).sum(),
                               [xs, ps])
    assert len(calls) == 1
    assert (x.grad - want[0]).abs().max().item() <= TOL
    assert (partial.grad - want[1]).abs().max().item() <= TOL
