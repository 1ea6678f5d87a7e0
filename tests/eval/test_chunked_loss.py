"""Chunked linear + cross-entropy equals the full-logit F.cross_entropy, values and gradients:
the op alone (float64), the trainer's path through a whole model (`hidden_from_head` +
`ChunkedCrossEntropy`, float32) and under CPU bf16 autocast (what the trainer uses on one
device with mixed_precision_param = bfloat16)."""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import build_model, global_batch
from tests.metrics import rel_max
from titan_moe.train.chunked_loss import (
    ChunkedCrossEntropy,
    chunked_linear_cross_entropy,
    hidden_from_head,
)

TOL = 1e-10  # float64
MODEL_RTOL = 1e-5  # float32, relative to each tensor's largest magnitude: summation order only
BF16_RTOL = 2e-2  # bf16 matmuls, the two paths round the logits and gradients differently


@pytest.fixture(autouse=True)
def one_thread():
    """Spinning OpenMP threads slow these tiny matmuls tenfold on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _model_loss_and_grads(chunk: int, autocast: bool) -> tuple[torch.Tensor, dict]:
    model = build_model()
    tokens, doc_ids = global_batch(model.args.vocab_size)
    tokens[0, 7] = -100  # an ignored label
    inputs, labels = tokens[:, :-1].clamp(min=0), tokens[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if chunk:
            with hidden_from_head(model.output):
                hidden = model(inputs, doc_ids)
            assert hidden.shape[-1] == model.args.dim  # the head computed no logits
            loss = ChunkedCrossEntropy(model.output, chunk)(hidden, labels)
        else:
            loss = F.cross_entropy(model(inputs, doc_ids).float().flatten(0, 1),
                                   labels.flatten(), reduction="sum", ignore_index=-100)
    (loss / labels.numel()).backward()
    assert model(inputs[:1, :8]).shape[-1] == model.args.vocab_size  # the head is back
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_trainer_loss_path_matches_full_logits_loss():
    loss, grads = _model_loss_and_grads(chunk=48, autocast=False)
    ref_loss, ref_grads = _model_loss_and_grads(chunk=0, autocast=False)
    assert rel_max(loss, ref_loss) < MODEL_RTOL
    assert grads.keys() == ref_grads.keys() and "output.weight" in grads
    for name, grad in grads.items():
        assert rel_max(grad, ref_grads[name]) < MODEL_RTOL, (name, rel_max(grad, ref_grads[name]))


def test_trainer_loss_path_under_bf16_autocast():
    loss, grads = _model_loss_and_grads(chunk=48, autocast=True)
    ref_loss, ref_grads = _model_loss_and_grads(chunk=0, autocast=True)
    assert rel_max(loss, ref_loss) < BF16_RTOL
    for name in ("output.weight", "tok_embeddings.weight", "layers.0.mixer.w_q.weight"):
        assert grads[name].dtype == torch.float32
        assert rel_max(grads[name], ref_grads[name]) < BF16_RTOL, (name, rel_max(grads[name],
                                                                          ref_grads[name]))
