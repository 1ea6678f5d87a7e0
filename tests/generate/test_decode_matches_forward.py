"""Prefill + step-by-step decode gives the logits of one full-sequence forward (float32, CPU).

Reference: the model's training forward (chunked KDA op over the whole sequence, SDPA over
expanded MLA keys) on each row alone, no cache. The cached path differs in the order of
floating-point operations only (chunk boundaries, absorbed MLA), so the tolerance is 1e-4 of the
largest logit.
"""

import pytest
import torch

from tests.metrics import rel_max
from titan_moe.serve.generate import Generator, Sampling, Session

RTOL = 1e-4


@pytest.mark.parametrize("pieces", [(64, 1, 1, 1), (37, 50, 1, 13, 1), (130, 1, 1)])
def test_chunked_prefill_then_steps_equal_full_forward(model, pieces):
    torch.manual_seed(1)
    total = sum(pieces)
    tokens = torch.randint(0, model.args.vocab_size, (2, total))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        outs, start = [], 0
        for n in pieces:
            valid = torch.ones(2, n, dtype=torch.bool)
            outs.append(model(tokens[:, start : start + n], cache=cache, valid=valid))
            start += n
    assert rel_max(torch.cat(outs, 1), full) < RTOL


def test_ragged_batch_equals_each_row_alone(model):
    """Right padding: rows of 5, 64 and 99 tokens prefilled in 64-token chunks, then 12 decode
    steps; every row's logits equal its own unpadded full forward."""
    torch.manual_seed(2)
    lengths = (5, 64, 99)
    prompts = [torch.randint(0, model.args.vocab_size, (n,)).tolist() for n in lengths]
    gen = Generator(model, prefill_chunk=64)
    session = gen.session(len(prompts))
    session.extend(prompts)
    done = session.decode(12, Sampling(temperature=1.0), generator=torch.Generator().manual_seed(0))
    for b, (prompt, completion) in enumerate(zip(prompts, done, strict=True)):
        row = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(row)[0].float(), -1)
        n = len(prompt)
        want = logp[n - 1 : n - 1 + len(completion.tokens)].gather(
            1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert rel_max(torch.tensor(completion.logprobs), want) < RTOL
        assert rel_max(torch.log_softmax(session.last_logits[b], -1), logp[-1]) < RTOL


def test_multi_turn_extend_continues_the_state(model):
    """decode, extend with an 'observation' of different length per row, decode again: equal
    to the full forward of the whole transcript."""
    torch.manual_seed(3)
    prompts = [[5, 6, 7], [8] * 70]
    session = Session(model, 2, prefill_chunk=64)
    session.extend(prompts)
    first = session.decode(4, Sampling(temperature=0))
    observations = [[9, 10, 11, 12, 13], [14]]
    session.extend(observations)
    second = session.decode(3, Sampling(temperature=0))
    for b in range(2):
        row = prompts[b] + first[b].tokens + observations[b] + second[b].tokens
        with torch.no_grad():
            logits = model(torch.tensor([row]))[0]
        assert second[b].tokens[0] == int(logits[len(row) - 4].argmax())
        assert rel_max(session.last_logits[b], logits[-1]) < RTOL


def test_kda_state_does_not_grow_with_context(model):
    """KDA: the same state tensors after 16 and after 400 tokens; MLA: one latent row a token."""
    sizes = {}
    for length in (16, 400):
        session = Session(model, 1, prefill_chunk=128)
        session.extend([[1] * length])
        kda = [c for c in session.cache if hasattr(c, "recurrent")]
        mla = [c for c in session.cache if hasattr(c, "kv")]
        assert kda and mla
        sizes[length] = sum(c.recurrent.numel() + c.conv.numel() for c in kda)
        for c in kda:
            h, d = model.args.n_heads, model.args.head_dim
            assert c.recurrent.shape == (1, h, d, d)
        for c in mla:
            width = model.args.kv_lora_rank + model.args.qk_rope_head_dim
            assert c.length == length and c.kv.shape[1] >= length
            assert c.kv.shape[-1] == width
    assert sizes[16] == sizes[400]
