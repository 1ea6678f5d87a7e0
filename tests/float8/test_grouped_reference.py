"""float8/grouped_reference.py, the rowwise float8 recipe's emulation that the GPU kernel is tested
against: its rounding, and its grouping and gradients against an exact float64 grouped product."""

import torch

from float8.grouped_reference import E4M3_MAX, quantized, rowwise_float8_grouped_mm


def test_quantized_rounds_each_row_to_nearest_e4m3_with_a_power_of_two_scale():
    """Each element's error is at most half an e4m3 step (2^-4 of its magnitude) where the scaled
    value is normal (>= 2^-6); the row's largest value lands in (224, 448] so no row is clipped or
    left in the low range; along dim 0 the same holds per column."""
    torch.manual_seed(0)
    t = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]
    for dim in (1, 0):
        q = quantized(t, dim)
        amax = t.abs().amax(dim, keepdim=True)
        scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
        assert torch.all((amax * scale > E4M3_MAX / 2) & (amax * scale <= E4M3_MAX))
        normal = (t * scale).abs() >= 2**-6
        assert torch.all((q - t).abs()[normal] <= 2**-4 * t.abs()[normal])
        assert torch.all((q - t).abs()[~normal] <= 2**-10 / scale.expand_as(t)[~normal])


def test_grouped_mm_equals_the_exact_product_on_representable_operands():
    """Operands in {-1, 0, 1} are exact in e4m3 at any power-of-two scale, and the sums (at most
    48 terms) exact in bf16, so forward and both gradients must equal the float64 grouped product
    and its autograd gradients exactly, an empty group included (its weight gradient zero)."""
    torch.manual_seed(0)
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    a = torch.randint(-1, 2, (64, 32)).to(torch.bfloat16)
    b_t = torch.randint(-1, 2, (4, 32, 24)).to(torch.bfloat16)
    grad_out = torch.randint(-1, 2, (64, 24)).to(torch.bfloat16)
    a_q, b_q = a.clone().requires_grad_(), b_t.clone().requires_grad_()
    rowwise_float8_grouped_mm(a_q, b_q, offs).backward(grad_out)
    out_q = rowwise_float8_grouped_mm(a, b_t, offs)
    a64, b64 = a.double().requires_grad_(), b_t.double().requires_grad_()
    starts = [0, *offs.tolist()[:-1]]
    out64 = torch.cat([a64[s:e] @ b64[i] for i, (s, e) in enumerate(zip(starts, offs.tolist(),
                                                                          strict=True))])
    out64.backward(grad_out.double())
    assert torch.equal(out_q.double(), out64.detach())
    assert torch.equal(a_q.grad.double(), a64.grad)
    assert torch.equal(b_q.grad.double(), b64.grad)
    assert not b_q.grad[1].any()
