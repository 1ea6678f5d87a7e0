"""GRPO post-training from a pre-trained checkpoint.

    python -m titan_moe.rl.train --config configs/rl_debug.toml [--rl.steps 5 --model.checkpoint D]
    CONFIG_FILE=configs/rl_debug.toml scripts/run_rl.sh [overrides]

Each step: `rl.tasks_per_step` tasks x `rl.group_size` multi-turn rollouts through the decode
cache (the policy in eval mode: routing reads the QB biases and accumulates nothing), group-relative
advantages, then one AdamW step on the token-level loss with a KL term to the frozen starting
model, over micro-batches of `rl.micro_batch` rows (rows longer than `rl.chunk_len` in chunks with
the KDA state carried). With `rl.freeze_qb = false` the update runs in train mode and Quantile
Balancing steps after the optimizer. `rl.compile_rollouts` decodes through the compiled
static-cache step (CUDA graphs on CUDA), compiled and captured before the first step so that
every step's speeds are warm, `rl.autocast` runs rollouts and update under bf16 autocast.
TensorBoard (output.dump_folder/tb): rl/reward, rl/success_rate, rl/trajectory_length, rl/kl,
rl/entropy, rl/loss, rl/grad_norm, rl/failures, rl/uniform_groups (groups of equal rewards:
no policy gradient), rl/rollout_tokens_per_s (sampled tokens),
rl/train_tokens_per_s (tokens through the update), rl/rollout_warmup_s (the compile, once).
The final model (and every save_interval steps) is written as a DCP checkpoint that
`python -m titan_moe.serve.generate --checkpoint` reads.
"""

import copy
import random
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.utils.tensorboard import SummaryWriter

from titan_moe.data.tokenizer import TitanTokenizer, asset_path
from titan_moe.model.args import ConfigError
from titan_moe.model.model import TitanMoE
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.rl.config import RLConfig, RLSection, load_rl_config
from titan_moe.rl.env import Environment, Tokenizer
from titan_moe.rl.envs.arithmetic import ArithmeticEnv
from titan_moe.rl.envs.python_exec import PythonExecEnv
from titan_moe.rl.envs.toy import CharTokenizer, TargetCharEnv
from titan_moe.rl.loss import group_advantages, grpo_loss, token_logprobs, uniform_group_share
from titan_moe.rl.rollout import Trajectory, rollout
from titan_moe.serve.generate import Generator, Sampling, load_model
from titan_moe.serve.static_decode import StaticGenerator
from titan_moe.train.checkpoint_verify import write_manifest
from titan_moe.train.optimizer import all_reduce_qb_stats


def build_env(config: RLConfig) -> tuple[Environment, Tokenizer]:
    vocab = config.model_args().vocab_size
    if config.rl.env == "toy":
        tokenizer = CharTokenizer()
        if tokenizer.get_vocab_size() > vocab:
            raise ConfigError(f"titan_moe.vocab_size = {vocab}: the toy env needs >= "
                              f"{tokenizer.get_vocab_size()}")
        return TargetCharEnv(), tokenizer
    tokenizer = TitanTokenizer(config.model.tokenizer or asset_path(vocab))
    return (ArithmeticEnv() if config.rl.env == "arithmetic" else PythonExecEnv()), tokenizer


def pad_batch(
    trajectories: Sequence[Trajectory], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T], valid [B, T] and the action mask of the targets [B, T-1]."""
    width = max(len(t.tokens) for t in trajectories)
    tokens = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(trajectories), width, dtype=torch.bool)
    actions = torch.zeros(len(trajectories), width, dtype=torch.bool)
    for b, t in enumerate(trajectories):
        tokens[b, : len(t.tokens)] = torch.tensor(t.tokens)
        valid[b, : len(t.tokens)] = True
        actions[b, : len(t.tokens)] = torch.tensor(t.action_mask)
    return tokens.to(device), valid.to(device), actions[:, 1:].to(device)


def update(
    policy: TitanMoE,
    reference: TitanMoE,
    optimizer: torch.optim.Optimizer,
    trajectories: list[Trajectory],
    advantages: torch.Tensor,
    config: RLConfig,
    pad_id: int,
) -> dict[str, float]:
    """One optimizer step on the GRPO loss over the batch, in micro-batches; returns stats."""
    rl = config.rl
    device = policy.output.weight.device
    n_tokens = max(sum(sum(t.action_mask) for t in trajectories), 1)
    policy.train(not rl.freeze_qb)
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "kl": 0.0, "entropy": 0.0}
    for start in range(0, len(trajectories), rl.micro_batch):
        part = trajectories[start : start + rl.micro_batch]
        tokens, valid, actions = pad_batch(part, pad_id, device)
        logp, entropy = token_logprobs(policy, tokens, valid, rl.chunk_len)
        with torch.no_grad():
            ref_logp, _ = token_logprobs(reference, tokens, valid, rl.chunk_len)
        adv = advantages[start : start + rl.micro_batch].to(device)
        loss, kl_sum = grpo_loss(logp, ref_logp, adv, actions, rl.kl_coef, n_tokens)
        loss.backward()
        totals["loss"] += float(loss.detach())
        totals["kl"] += float(kl_sum) / n_tokens
        totals["entropy"] += float((entropy.detach() * actions).sum()) / n_tokens
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), rl.max_norm))
    optimizer.step()
    policy.eval()
    return totals


def save(model: TitanMoE, folder: Path, step: int) -> Path:
    """A DCP checkpoint of the policy, with the trainer's manifest (its files' chunk digests and
    the model args), so serve/generate.py and a later RL run verify it before loading it."""
    path = folder / f"step-{step}"
    dcp.save(model.state_dict(), checkpoint_id=str(path))
    write_manifest(path, model.args)
    return path


def rollout_cache_slots(rl: RLSection, max_turns: int) -> int:
    """Static cache slots a row that a batch of rollouts can fill. A session writes the same
    slots for every row (the longest prompt, each turn's decode budget, the longest observation),
    and each row's own tokens stay within rl.max_len, so: a prompt of at most max_len, then per
    turn max_turn_tokens decoded and an observation of at most max_len."""
    return rl.max_len + max_turns * (rl.max_turn_tokens + rl.max_len)


def build_generator(policy: TitanMoE, rl: RLSection, max_turns: int) -> Generator:
    if rl.compile_rollouts:
        return StaticGenerator(policy, prefill_chunk=rl.prefill_chunk,
                               max_len=rollout_cache_slots(rl, max_turns))
    return Generator(policy, prefill_chunk=rl.prefill_chunk)


def warm_up_rollouts(generator: Generator, batch: int, bos_id: int) -> float:
    """Seconds a compiled generator takes to compile its decode step for `batch` rows and, on
    CUDA, to capture its graphs (cudagraph trees record on the second call, replay from the
    third), paid here so that the first step's rollout tokens/s is a warm figure. Call it under
    the rollouts' autocast state: the compiled step is guarded on it."""
    began = time.perf_counter()
    session = generator.session(batch)
    session.extend([[bos_id]] * batch)
    session.decode(3, Sampling(temperature=0.0))
    if session.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def train(config: RLConfig) -> list[dict[str, float]]:
    """Run config.rl.steps GRPO steps; returns each step's metrics."""
    rl = config.rl
    device = "cuda" if rl.device == "auto" and torch.cuda.is_available() else (
        "cpu" if rl.device == "auto" else rl.device)
    env, tokenizer = build_env(config)
    checkpoint = None if config.model.random_init else config.model.checkpoint
    policy = load_model(checkpoint, config.model_args(), device,
                        getattr(torch, config.model.dtype), seed=rl.seed)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=0.0)
    balancer = None if rl.freeze_qb else QuantileBalancer(policy)
    generator = build_generator(policy, rl, env.max_turns)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=rl.autocast)
    sampling = Sampling(rl.temperature, rl.top_p)
    rng = random.Random(rl.seed)
    torch_rng = torch.Generator(device=device).manual_seed(rl.seed)
    dump = Path(config.output.dump_folder)
    writer = SummaryWriter(str(dump / "tb"))
    if rl.compile_rollouts:
        with amp:
            warmup_s = warm_up_rollouts(generator, rl.tasks_per_step * rl.group_size,
                                        tokenizer.bos_id)
        writer.add_scalar("rl/rollout_warmup_s", warmup_s, 0)
        print(f"rollout warm-up (decode step compiled and captured): {warmup_s:.1f} s", flush=True)
    history = []
    for step in range(1, rl.steps + 1):
        began = time.perf_counter()
        with amp:
            trajectories = rollout(generator, env, tokenizer, rng, rl.tasks_per_step,
                                   rl.group_size, rl.max_turn_tokens, rl.max_len, sampling,
                                   torch_rng)
        rolled = time.perf_counter()
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = group_advantages(rewards, rl.group_size)
        with amp:
            stats = update(policy, reference, optimizer, trajectories, advantages, config,
                           tokenizer.eos_id)
        if device == "cuda":  # the optimizer step's kernels, in the update's time
            torch.cuda.synchronize()
        updated = time.perf_counter()
        if balancer is not None:
            all_reduce_qb_stats(balancer.routers)
            balancer.step()
            stats.update(balancer.metrics())
        stats.update({
            "reward": float(rewards.mean()),
            "success_rate": sum(t.success for t in trajectories) / len(trajectories),
            "trajectory_length": sum(len(t.tokens) for t in trajectories) / len(trajectories),
            "turns": sum(t.turns for t in trajectories) / len(trajectories),
            "failures": sum(t.info not in ("", "turns", "length") for t in trajectories)
            / len(trajectories),
            "uniform_groups": uniform_group_share(rewards, rl.group_size),
            "step_time_s": time.perf_counter() - began,
            # Sampled tokens a second of the rollouts (sandboxed tool calls included), and the
            # tokens the update runs through the policy (and the reference) a second.
            "rollout_tokens_per_s": sum(sum(t.action_mask) for t in trajectories)
            / (rolled - began),
            "train_tokens_per_s": sum(len(t.tokens) for t in trajectories) / (updated - rolled),
        })  # fmt: skip
        history.append(stats)
        for name, value in stats.items():
            writer.add_scalar(name if name.startswith("moe/") else f"rl/{name}", value, step)
        if step % config.output.log_freq == 0:
            print(f"step {step:3d}  reward {stats['reward']:.3f}  success "
                  f"{stats['success_rate']:.2f}  len {stats['trajectory_length']:.0f}  "
                  f"kl {stats['kl']:.4f}  entropy {stats['entropy']:.3f}  "
                  f"{stats['step_time_s']:.1f} s  rollouts {stats['rollout_tokens_per_s']:.0f} "
                  f"tok/s  update {stats['train_tokens_per_s']:.0f} tok/s", flush=True)
        if rl.save_interval and step % rl.save_interval == 0 and step != rl.steps:
            save(policy, dump / "checkpoint", step)
    writer.close()
    save(policy, dump / "checkpoint", rl.steps)
    return history


def parse_overrides(argv: Sequence[str]) -> tuple[str, dict[str, dict]]:
    """`--config F --table.key value ...` -> (F, {table: {key: TOML-parsed value}})."""
    config, overrides = None, {}
    args = list(argv)
    while args:
        flag = args.pop(0)
        if not flag.startswith("--") or not args:
            raise ConfigError(f"expected --config F or --table.key VALUE, got {flag!r}")
        value = args.pop(0)
        if flag == "--config":
            config = value
            continue
        table, _, key = flag[2:].partition(".")
        if not key:
            raise ConfigError(f"{flag}: write --table.key VALUE, e.g. --rl.steps 5")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        overrides.setdefault(table, {})[key] = parsed
    if config is None:
        raise ConfigError("--config F is required (e.g. configs/rl_debug.toml)")
    return config, overrides


def main(argv: Sequence[str] | None = None) -> None:
    try:
        path, overrides = parse_overrides(sys.argv[1:] if argv is None else argv)
        config = load_rl_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    train(config)


if __name__ == "__main__":
    main()
