"""Sampling: the nucleus against a hand-computed one, empirical frequencies against the target
distribution (20000 draws: a frequency's standard error is at most 0.0036, the tolerance 0.015
is over 4 of them), temperature 0 = argmax, stop tokens and batch independence."""

import pytest
import torch

from titan_moe.serve.generate import Generator, Sampling, sample, top_p_filter

DRAWS = 20000
FREQ_TOL = 0.015


def _frequencies(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = sample(logits.expand(DRAWS, -1), sampling, gen)
    return torch.bincount(ids, minlength=logits.shape[-1]).double() / DRAWS


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([[0, 0.625, 0, 0.375]]))
    kept = top_p_filter(probs, 0.81)
    assert torch.allclose(kept, torch.tensor([[0, 0.5, 0.15, 0.3]]) / 0.95)
    assert torch.equal(top_p_filter(probs, 0.3) > 0, torch.tensor([[False, True, False, False]]))


def test_sampled_frequencies_match_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    for sampling in (Sampling(1.0, 1.0), Sampling(0.5, 1.0), Sampling(1.3, 0.7)):
        target = torch.softmax(logits / sampling.temperature, -1)
        if sampling.top_p < 1:
            target = top_p_filter(target, sampling.top_p)
        freq = _frequencies(logits, sampling)
        assert (freq - target[0].double()).abs().max() < FREQ_TOL, sampling
        assert freq[target[0] == 0].sum() == 0


def test_temperature_zero_is_argmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, Sampling(temperature=0)), logits.argmax(-1))


def test_bad_sampling_values_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)


def test_stop_token_ends_only_its_row_and_batching_changes_nothing(model):
    prompts = [[3, 4, 5, 6], list(range(10, 60))]
    gen = Generator(model, prefill_chunk=64)
    greedy = Sampling(temperature=0)
    alone = [gen.generate([p], 10, greedy, stop_tokens=[])[0] for p in prompts]
    stop = alone[0].tokens[3]
    first_stop = alone[0].tokens.index(stop)
    done = gen.generate(prompts, 10, greedy, stop_tokens=[stop])
    assert done[0].stopped and done[0].tokens == alone[0].tokens[: first_stop + 1]
    expected = alone[1].tokens
    if stop in expected:
        expected = expected[: expected.index(stop) + 1]
    assert done[1].tokens == expected
    assert done[1].stopped == (stop in alone[1].tokens)
