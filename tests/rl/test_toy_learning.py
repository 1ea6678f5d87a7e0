"""GRPO on the toy env (reward = share of 'a' in the actions, two turns) from a seeded random
tiny model: the mean reward of the last 5 of 30 updates beats the first 5 by more than 0.4
(the run goes from about 0.07 to about 1.0); the TensorBoard tags are written; a checkpoint is
saved with its manifest and loads verified, with the trained weights. Also: a crashing
environment costs its own trajectory only; rollouts through the static cache stay within its
slot bound; compiled rollouts under autocast train and log their speeds; the rollout warm-up
compiles the decode step that the rollouts then run, so none compiles in a step."""

import dataclasses
import math
import random

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_moe.rl.config import load_rl_config
from titan_moe.rl.envs.toy import CharTokenizer, TargetCharEnv
from titan_moe.rl.rollout import rollout
from titan_moe.serve.generate import Generator, Sampling, load_model
from titan_moe.serve.static_decode import StaticGenerator
from titan_moe.train.checkpoint_verify import verify_checkpoint

TINY = {"vocab_size": 16, "dim": 64, "n_layers": 2, "mla_layers": [2], "dense_hidden": 64,
        "n_heads": 2, "head_dim": 16, "kda_gate_rank": 16, "mla_n_heads": 2, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_experts": 4, "top_k": 2, "latent_dim": 32, "expert_hidden": 32, "shared_hidden": 32}


def _config(tmp_path, steps):
    return load_rl_config("configs/rl_debug.toml", {
        "model": {"random_init": True, "checkpoint": ""},
        "rl": {"env": "toy", "steps": steps, "tasks_per_step": 4, "group_size": 4,
               "max_turn_tokens": 4, "max_len": 64, "lr": 3e-3, "kl_coef": 0.0, "chunk_len": 64,
               "micro_batch": 16, "prefill_chunk": 64, "device": "cpu"},
        "output": {"dump_folder": str(tmp_path), "log_freq": 10},
        "titan_moe": TINY,
    })


def test_mean_reward_rises(tmp_path):
    from titan_moe.rl.train import train

    rewards = [h["reward"] for h in train(_config(tmp_path, 30))]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.4, rewards
    (run,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    for tag in ("rl/reward", "rl/success_rate", "rl/trajectory_length", "rl/kl", "rl/entropy"):
        assert len(events.Scalars(tag)) == 30, tag
    saved = tmp_path / "checkpoint" / "step-30"
    assert (saved / ".metadata").is_file()
    # The save carries the trainer's manifest: generate verifies it and loads these weights.
    args = _config(tmp_path, 30).model_args()
    verify_checkpoint(saved, args)
    trained, initial = load_model(saved, args), load_model(None, args)
    assert not torch.equal(trained.output.weight, initial.output.weight)


class CrashingEnv(TargetCharEnv):
    def step(self, episode, action):
        if episode.prompt[0] in "abcd":
            raise RuntimeError("tool crashed")
        return super().step(episode, action)


def test_crashing_tool_costs_only_its_trajectory(tmp_path):
    config = _config(tmp_path, 1)
    model = load_model(None, config.model_args())
    trajs = rollout(Generator(model, prefill_chunk=64), CrashingEnv(), CharTokenizer(),
                    random.Random(0), 8, 2, 4, 64, Sampling())
    crashed = [t for t in trajs if "tool crashed" in t.info]
    assert crashed and len(crashed) < len(trajs)
    assert all(t.reward == 0 for t in crashed)
    assert all(t.turns == 2 for t in trajs if t not in crashed)


def test_rollouts_fit_the_static_cache_bound(tmp_path):
    """Rollouts through a static cache of exactly rollout_cache_slots slots. The session writes
    the same slots for every row (the longest prompt, each turn's decode budget, the longest
    observation), so it fills more slots than any row holds tokens: here more than rl.max_len (a
    cache of max_len slots would have raised), and no more than the bound."""
    from titan_moe.rl.train import rollout_cache_slots

    config = _config(tmp_path, 1)
    rl = dataclasses.replace(config.rl, max_turn_tokens=8, max_len=12)
    model = load_model(None, config.model_args())
    env = TargetCharEnv()
    slots = rollout_cache_slots(rl, env.max_turns)
    generator = StaticGenerator(model, prefill_chunk=64, max_len=slots, compile=False)
    trajs = rollout(generator, env, CharTokenizer(), random.Random(0), 4, 2, rl.max_turn_tokens,
                    rl.max_len, Sampling())
    (session,) = generator.sessions.values()
    assert rl.max_len < session.filled <= slots, (session.filled, slots)
    assert all(len(t.tokens) <= rl.max_len for t in trajs)


def test_compiled_rollouts_under_autocast_report_both_speeds(tmp_path):
    from titan_moe.rl.train import build_generator, rollout_cache_slots, train

    config = _config(tmp_path, 2)
    config.rl.compile_rollouts = True
    config.rl.autocast = True
    generator = build_generator(load_model(None, config.model_args()), config.rl, 2)
    assert isinstance(generator, StaticGenerator)
    assert generator.max_len == rollout_cache_slots(config.rl, 2)
    history = train(config)
    for step in history:
        assert step["rollout_tokens_per_s"] > 0 and step["train_tokens_per_s"] > 0, step
        assert 0 <= step["reward"] <= 1 and math.isfinite(step["loss"]), step
    (run,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    for tag in ("rl/rollout_tokens_per_s", "rl/train_tokens_per_s", "rl/uniform_groups"):
        assert len(events.Scalars(tag)) == 2, tag
    (warmup,) = events.Scalars("rl/rollout_warmup_s")
    assert warmup.step == 0 and warmup.value > 0, warmup


def test_the_rollout_warmup_compiles_the_step_the_rollouts_run(tmp_path):
    """Compiles counted by Dynamo (eager backend): one by the warm-up, none more by a rollout of
    the same batch; a warm-up of another batch size would leave the rollout its own compile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from titan_moe.rl.train import rollout_cache_slots, warm_up_rollouts

    config = _config(tmp_path, 1)
    rl, env, tokenizer = config.rl, TargetCharEnv(), CharTokenizer()
    counter = CompileCounterWithBackend("eager")
    generator = StaticGenerator(load_model(None, config.model_args()), prefill_chunk=64,
                                max_len=rollout_cache_slots(rl, env.max_turns), mode=None,
                                backend=counter)
    torch._dynamo.reset()
    batch = rl.tasks_per_step * rl.group_size
    assert warm_up_rollouts(generator, batch, tokenizer.bos_id) > 0
    assert counter.frame_count == 1
    rollout(generator, env, tokenizer, random.Random(0), rl.tasks_per_step, rl.group_size,
            rl.max_turn_tokens, rl.max_len, Sampling())
    assert counter.frame_count == 1
