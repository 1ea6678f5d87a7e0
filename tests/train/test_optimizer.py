"""Weight decay reaches ≥2-D weights only; 1-D ones (norms, A_log, dt_bias, AttnRes) get none.

Reference: AdamW's decoupled decay with zero gradients multiplies a decayed weight by exactly
(1 - lr·wd) and leaves an undecayed one unchanged.
"""

import torch
from torchtitan.components.optimizer import OptimizersContainer

from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.train.optimizer import exclude_1d_from_weight_decay

LR, WD = 0.1, 0.5


def test_one_dimensional_parameters_are_not_decayed():
    args = get_flavor("debug")
    args.n_layers, args.mla_layers = 2, (2,)
    model = TitanMoE(args.validate())
    model.init_weights()
    optimizers = OptimizersContainer(
        [model], torch.optim.AdamW, {"lr": LR, "weight_decay": WD, "foreach": False}
    )
    exclude_1d_from_weight_decay(optimizers)
    names = {p: n for n, p in model.named_parameters()}
    no_decay = {names[p] for p in optimizers.optimizers[0].param_groups[1]["params"]}
    assert {"layers.1.mixer_site.query", "layers.1.mixer_site.gain", "layers.0.mixer.A_log",
            "layers.0.mixer.dt_bias", "final_site.query", "norm.weight"} <= no_decay
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()
    for n, p in model.named_parameters():
        factor = 1.0 if n in no_decay else 1 - LR * WD
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=1e-6, atol=0)
        assert (n in no_decay) == (p.ndim == 1), n
