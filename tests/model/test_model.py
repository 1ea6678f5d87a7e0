"""The whole decoder: packed documents stay independent; experts and decays are initialised.

Compiled vs eager lives in tests/parity/."""

import torch

from tests.metrics import rel_max
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE


def _debug_model(dtype=torch.float32, **overrides) -> TitanMoE:
    torch.manual_seed(0)
    args = get_flavor("debug")
    for k, v in overrides.items():
        setattr(args, k, v)
    model = TitanMoE(args.validate()).to(dtype)
    model.init_weights()
    # Non-zero AttnRes queries so the test also covers a non-uniform mix.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0, 0.05)
    return model


def test_packed_documents_do_not_see_each_other():
    model = _debug_model(torch.float64).eval()
    torch.manual_seed(1)
    t1, t2 = 37, 91  # second document starts mid-chunk and spans a chunk boundary
    tokens = torch.randint(0, model.args.vocab_size, (1, t1 + t2))
    doc_ids = torch.tensor([[0] * t1 + [1] * t2])
    packed = model(tokens, doc_ids)
    alone = model(tokens[:, t1:])
    first = model(tokens[:, :t1])
    assert rel_max(packed[:, t1:], alone) < 1e-10
    assert rel_max(packed[:, :t1], first) < 1e-10


def test_every_routed_expert_is_initialised():
    model = _debug_model()
    for name, p in model.named_parameters():
        if ".ffn.experts." in name:
            per_expert = p.detach().flatten(1)
            assert torch.isfinite(per_expert).all(), name
            assert (per_expert.std(1) > 0).all(), name
            assert len({tuple(r[:8].tolist()) for r in per_expert}) == p.shape[0], name


def test_kda_decay_init_follows_the_spec():
    model = _debug_model()
    for layer in model.layers.values():
        if hasattr(layer.mixer, "dt_bias"):
            dt = torch.nn.functional.softplus(layer.mixer.dt_bias.detach().double())
            assert dt.min() >= 1e-3 * (1 - 1e-6) and dt.max() <= 1e-1 * (1 + 1e-6)
            assert dt.log().std() > 0.5  # log-uniform over a factor of 100, not a constant
            assert torch.equal(layer.mixer.A_log.detach(), torch.zeros_like(layer.mixer.A_log))
