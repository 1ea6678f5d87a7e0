"""The RL job config (`configs/rl_debug.toml`): four tables, each checked at the boundary.

    [model]     flavor, checkpoint (DCP folder from training), random_init (tests), dtype,
                tokenizer
    [titan_moe] model-arg overrides, as in the training TOMLs
    [rl]        environment, batch shape, sampling, optimisation, chunking, QB freezing
    [output]    dump_folder (TensorBoard under dump_folder/tb, checkpoints under .../checkpoint)

An unknown table or key, a value of the wrong type or out of range raises one ConfigError that
names the key and what is allowed.
"""

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args

ENVIRONMENTS = ("arithmetic", "python", "toy")


@dataclass
class ModelSection:
    flavor: str = "debug"
    checkpoint: str = ""
    random_init: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    tokenizer: str = ""


@dataclass
class RLSection:
    env: Literal["arithmetic", "python", "toy"] = "arithmetic"
    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    max_turn_tokens: int = 64
    max_len: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-5
    kl_coef: float = 0.05
    max_norm: float = 1.0
    chunk_len: int = 512
    micro_batch: int = 8
    prefill_chunk: int = 512
    freeze_qb: bool = True
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    save_interval: int = 0
    # Rollouts through serve/static_decode.py's compiled decode step on a static cache (CUDA
    # graphs on CUDA) instead of the eager session.
    compile_rollouts: bool = False
    # Rollouts and the update under bf16 autocast (fp32 weights and optimizer, bf16 matmuls): the
    # fast kernels of the proxy and full flavors take bf16.
    autocast: bool = False


@dataclass
class OutputSection:
    dump_folder: str = "./outputs/rl_debug"
    log_freq: int = 1


@dataclass
class RLConfig:
    model: ModelSection = field(default_factory=ModelSection)
    rl: RLSection = field(default_factory=RLSection)
    output: OutputSection = field(default_factory=OutputSection)
    titan_moe: dict[str, Any] = field(default_factory=dict)

    def model_args(self) -> TitanMoEArgs:
        return model_args(self.model.flavor, **self.titan_moe)


def _typed(cls: type, table: Any, where: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(f"unknown key {where}.{key}; allowed: {', '.join(names)}")
        hint = hints[key]
        allowed = get_args(hint) if getattr(hint, "__origin__", None) is Literal else None
        if allowed is not None:
            ok, expected = value in allowed, f"one of {allowed}"
        elif hint is float:
            ok, expected = isinstance(value, int | float) and not isinstance(value, bool), "float"
        else:
            ok, expected = type(value) is hint, hint.__name__
        if not ok:
            raise ConfigError(f"{where}.{key} = {value!r}: expected {expected}")
    return cls(**table)


def _check(config: RLConfig) -> RLConfig:
    rl = config.rl
    for name in ("steps", "tasks_per_step", "group_size", "max_turn_tokens", "max_len",
                 "chunk_len", "micro_batch", "prefill_chunk"):
        if getattr(rl, name) <= 0:
            raise ConfigError(f"rl.{name} = {getattr(rl, name)}: must be positive")
    if rl.group_size < 2:
        raise ConfigError(f"rl.group_size = {rl.group_size}: GRPO needs at least 2 per group")
    if not 0 < rl.top_p <= 1:
        raise ConfigError(f"rl.top_p = {rl.top_p}: must be in (0, 1]")
    if rl.temperature <= 0:
        raise ConfigError(f"rl.temperature = {rl.temperature}: rollouts must sample (> 0)")
    if rl.lr <= 0 or rl.kl_coef < 0 or rl.max_norm <= 0:
        raise ConfigError("rl.lr and rl.max_norm must be > 0 and rl.kl_coef >= 0")
    if rl.prefill_chunk % 64:
        raise ConfigError(f"rl.prefill_chunk = {rl.prefill_chunk}: must be a multiple of 64")
    if not config.model.random_init and not config.model.checkpoint:
        raise ConfigError("model.checkpoint is required (a DCP folder from titan_moe.train), "
                          "or set model.random_init = true (tests only)")
    if config.model.checkpoint and not Path(config.model.checkpoint).exists():
        raise ConfigError(f"model.checkpoint = {config.model.checkpoint!r}: no such folder")
    config.model_args()
    return config


def load_rl_config(
    path: str | Path, overrides: dict[str, dict[str, Any]] | None = None
) -> RLConfig:
    """Read, merge `overrides` ({table: {key: value}}) over, and check an RL TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path, "rb") as f:
        values = tomllib.load(f)
    for table, entries in (overrides or {}).items():
        values.setdefault(table, {}).update(entries)
    known = {"model": ModelSection, "rl": RLSection, "output": OutputSection}
    for table in values:
        if table not in (*known, "titan_moe"):
            raise ConfigError(f"unknown table [{table}] in {path}; allowed: "
                              "model, rl, output, titan_moe")
    sections = {name: _typed(cls, values.get(name, {}), name) for name, cls in known.items()}
    return _check(RLConfig(**sections, titan_moe=values.get("titan_moe", {})))
