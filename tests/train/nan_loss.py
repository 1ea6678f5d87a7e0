"""`--experimental.custom_import tests.train.nan_loss`: the loss of the steps listed in $NAN_STEPS
(comma-separated) is NaN, so their gradients and grad norm are NaN too; only on the ranks in
$NAN_RANKS if that is set.

Patches torchtitan's Trainer, the class our trainer (titan_moe/train/trainer.py) builds on, so
the patch holds however the trainer is started (`python -m titan_moe.train`, torchrun).
"""

import os

from torchtitan.train import Trainer

NAN_STEPS = {int(s) for s in os.environ.get("NAN_STEPS", "").split(",") if s}
NAN_RANKS = {int(r) for r in os.environ.get("NAN_RANKS", "").split(",") if r}
_forward_backward_step = Trainer.forward_backward_step


def forward_backward_step(self, **kwargs):
    rank = int(os.environ.get("RANK", "0"))
    if self.step not in NAN_STEPS or (NAN_RANKS and rank not in NAN_RANKS):
        return _forward_backward_step(self, **kwargs)
    loss_fn = self.loss_fn
    self.loss_fn = lambda *args, **kw: loss_fn(*args, **kw) * float("nan")
    try:
        return _forward_backward_step(self, **kwargs)
    finally:
        self.loss_fn = loss_fn


Trainer.forward_backward_step = forward_backward_step
