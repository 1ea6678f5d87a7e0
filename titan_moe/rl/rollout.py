"""Rollouts: G samples of each task, decoded turn by turn through one generator Session.

Every row keeps its decode state across turns: a tool result is prefilled into the row's
recurrent KDA state and MLA latent cache, never re-read from the start. A row ends when the
environment says so, when its turns run out, or at the length budget (reward 0, "length").
An exception from the environment ends that row only (reward 0, the error in `info`).
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from titan_moe.rl.env import TOOL_CALL_END, Environment, Episode, StepResult, Tokenizer
from titan_moe.serve.generate import Generator, Sampling


@dataclass
class Trajectory:
    group: int
    tokens: list[int]
    action_mask: list[bool]  # True on tokens the policy generated (trained on)
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    info: str = ""
    logprobs: list[float] = field(default_factory=list)  # of action tokens, at sampling time


def stop_tokens(tokenizer: Tokenizer) -> list[int]:
    tool_end = tokenizer.token_to_id(TOOL_CALL_END)
    return [tokenizer.eos_id] + ([] if tool_end is None else [tool_end])


def _safe_step(env: Environment, episode: Episode, action: str) -> StepResult:
    try:
        return env.step(episode, action)
    except Exception as e:  # a broken tool ends its trajectory, not the run
        return StepResult(done=True, info=f"env error: {type(e).__name__}: {e}")


def rollout(
    generator: Generator,
    env: Environment,
    tokenizer: Tokenizer,
    rng: random.Random,
    n_tasks: int,
    group_size: int,
    max_turn_tokens: int,
    max_len: int,
    sampling: Sampling,
    torch_generator=None,
) -> list[Trajectory]:
    """n_tasks tasks x group_size samples each, in one batch of n_tasks * group_size rows."""
    episodes: list[Episode] = []
    trajectories: list[Trajectory] = []
    for group in range(n_tasks):
        seed = rng.getrandbits(63)
        for _ in range(group_size):
            episode = env.reset(random.Random(seed))
            episodes.append(episode)
            prompt = tokenizer.encode(episode.prompt, add_bos=True, add_eos=False)
            trajectories.append(Trajectory(group, prompt, [False] * len(prompt)))
    session = generator.session(len(episodes))
    session.extend([t.tokens for t in trajectories])
    running = [True] * len(episodes)
    stops = stop_tokens(tokenizer)
    for _ in range(env.max_turns):
        budget = [max_len - len(t.tokens) for t in trajectories]
        for b, left in enumerate(budget):
            if running[b] and left <= 0:
                running[b] = False
                trajectories[b].info = "length"
        if not any(running):
            break
        turn = session.decode(min(max_turn_tokens, max(budget)), sampling, stops, running,
                              torch_generator)
        observations: list[Sequence[int]] = [[] for _ in episodes]
        for b, completion in enumerate(turn):
            if not running[b]:
                continue
            traj = trajectories[b]
            tokens = completion.tokens[: budget[b]]
            traj.tokens += tokens
            traj.action_mask += [True] * len(tokens)
            traj.logprobs += completion.logprobs[: len(tokens)]
            traj.turns += 1
            result = _safe_step(env, episodes[b], tokenizer.decode(tokens))
            if result.done:
                running[b] = False
                traj.reward, traj.success, traj.info = result.reward, result.success, result.info
            else:
                obs = tokenizer.encode(result.observation, add_bos=False, add_eos=False)
                obs = obs[: max(0, max_len - len(traj.tokens))]
                traj.tokens += obs
                traj.action_mask += [False] * len(obs)
                observations[b] = obs
        if any(running):
            session.extend(observations)
    for b, traj in enumerate(trajectories):
        if running[b]:
            traj.info = traj.info or "turns"
    return trajectories
