"""GRPO's per-group statistics against plain Python loops over the groups: the advantages
(reward minus the group mean, over the group's population std plus 1e-6; tolerance 1e-12,
float64) and the share of groups whose rewards are all equal (exact)."""

import statistics

import torch

from titan_moe.rl.loss import group_advantages, uniform_group_share


def _groups(rewards: list[float], size: int) -> list[list[float]]:
    return [rewards[i:i + size] for i in range(0, len(rewards), size)]


def test_advantages_and_uniform_groups_match_loops():
    rewards = [0.0, 0.0, 0.0, 0.0,  1.0, 1.0, 1.0, 1.0,  0.0, 1.0, 0.5, 0.0,  0.2, 0.2, 0.2, 0.9]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4)
    expected = [(r - statistics.fmean(g)) / (statistics.pstdev(g) + 1e-6)
                for g in _groups(rewards, 4) for r in g]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    uniform = sum(len(set(g)) == 1 for g in _groups(rewards, 4)) / 4
    assert uniform_group_share(torch.tensor(rewards), 4) == uniform == 0.5
    # A uniform group's advantages are all 0: it adds no policy gradient.
    assert torch.equal(adv[:8], torch.zeros(8, dtype=torch.float64))
