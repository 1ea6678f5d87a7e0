"""Chunked linear + cross-entropy equals the full-logit F.cross_entropy, values and gradients."""

import torch
import torch.nn.functional as F

from titan_moe.chunked_loss import chunked_linear_cross_entropy

TOL = 1e-10  # float64


def test_chunked_loss_and_gradients_match_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37))
    labels[0, 5] = -100
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk=8)
    d_hidden, d_weight = torch.autograd.grad(loss * 0.7, (hidden, weight))
    reference = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(),
                                reduction="sum", ignore_index=-100)
    ref_hidden, ref_weight = torch.autograd.grad(reference * 0.7, (hidden, weight))
    assert abs(loss.item() - reference.item()) < TOL * reference.item()
    assert (d_hidden - ref_hidden).abs().max() < TOL
    assert (d_weight - ref_weight).abs().max() < TOL
