"""RMSNorm with `saves_output` on CUDA (`pytest -m gpu`), eager and compiled by Inductor, at the
proxy's width (8,192 tokens of d 2048, bf16): its gradients within tests/model/test_norm.py's
bf16 bound of float64 F.rms_norm, and its backward keeping its output, not its input (what
lets a long-context layer's backward drop the AttnRes sites' outputs)."""

import pytest
import torch

from tests.metrics import rel_rms
from tests.model.test_norm import BF16_BOUND, inputs, reference, run, saving_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_saving_output_norm_on_cuda(compiled):
    x, w, dy = inputs(torch.bfloat16, tokens=8192, dim=2048, device="cuda")
    y, dx, dw, saved, leaf = run(saving_norm(w), x, dy, compiled)
    y_ref, dx_ref, dw_ref = reference(x, w, dy)
    assert rel_rms(y, y_ref) < 2.0**-8
    assert rel_rms(dx, dx_ref) < BF16_BOUND
    assert rel_rms(dw, dw_ref) < BF16_BOUND
    assert y.untyped_storage()._cdata in saved
    assert leaf.untyped_storage()._cdata not in saved
    assert [t.dtype for t in saved.values() if t.numel() == x.numel()] == [torch.bfloat16]
