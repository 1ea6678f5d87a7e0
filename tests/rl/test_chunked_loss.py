"""Chunked training with the decode state carried between chunks equals the unchunked loss and
gradients (float32; reference: one training forward of the whole padded batch). Tolerance 1e-4
relative: the two paths differ only in floating-point order."""

import torch

from titan_moe.model.args import apply_overrides, get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.rl.loss import group_advantages, grpo_loss, token_logprobs

TINY = {
    "vocab_size": 32, "dim": 64, "n_layers": 4, "mla_layers": [2, 4], "dense_hidden": 64,
    "n_heads": 2, "head_dim": 16, "kda_gate_rank": 16, "mla_n_heads": 2, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_experts": 4, "top_k": 2, "latent_dim": 32, "expert_hidden": 32, "shared_hidden": 32,
}
RTOL = 1e-4


def _loss_and_grads(model, tokens, valid, actions, adv, ref, chunk_len):
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, tokens, valid, chunk_len)
    loss, _ = grpo_loss(logp, ref, adv, actions, kl_coef=0.1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_chunked_with_carried_state_equals_unchunked():
    torch.manual_seed(0)
    model = TitanMoE(apply_overrides(get_flavor("debug"), dict(TINY)))
    model.init_weights()
    model.eval()
    lengths = [150, 70]
    tokens = torch.randint(0, 32, (2, 150))
    valid = torch.arange(150)[None] < torch.tensor(lengths)[:, None]
    actions = valid[:, 1:] & (torch.arange(149)[None] >= 10)
    ref = torch.log_softmax(torch.randn(2, 149, 32), -1)[..., 0]
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2)
    loss_full, grads_full = _loss_and_grads(model, tokens, valid, actions, adv, ref, 1000)
    loss_chunk, grads_chunk = _loss_and_grads(model, tokens, valid, actions, adv, ref, 64)
    assert abs(float(loss_chunk - loss_full)) <= RTOL * abs(float(loss_full))
    assert grads_full.keys() == grads_chunk.keys()
    for name, g in grads_full.items():
        scale = g.abs().max().clamp_min(1e-12)
        assert float((grads_chunk[name] - g).abs().max() / scale) < RTOL, name
