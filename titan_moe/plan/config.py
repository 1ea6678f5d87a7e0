"""What a plan reads of a titan_moe TOML (`PlanConfig`): the model, sequence length, local batch,
activation checkpointing, loss chunk, activation offload and context-parallel degree; the plan
needs nothing else of the trainer's config."""

import tomllib
from dataclasses import dataclass

from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE

AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class PlanConfig:
    args: TitanMoEArgs
    seq_len: int
    local_batch: int
    ac_mode: str
    selective_ac_option: str
    loss_chunk: int = 0  # training.loss_chunk: positions a chunk of the LM-head loss; 0: full
    offload: bool = False  # training.activation_offload: saved tensors to pinned host memory
    cp: int = 1  # parallelism.context_parallel_degree: a GPU holds seq_len / cp positions


def _field(table: dict, section: str, key: str, kind: type, default, valid, allowed: str):
    value = table.get(section, {}).get(key, default)
    # bool is an int subclass: a flag given as a count (or a count as a flag) is a mistake.
    if type(value) is not kind or not valid(value):
        raise ConfigError(f"{section}.{key} = {value!r}: allowed {allowed}")
    return value


def load_plan_config(path: str) -> PlanConfig:
    """The model, sequence length, batch, AC policy, loss chunk, activation offload and context
    parallelism of a TOML (nothing else is needed)."""
    with open(path, "rb") as f:
        toml = tomllib.load(f)
    model = toml.get("model", {})
    args = model_args(model.get("flavor", "debug"), **toml.get("titan_moe", {}))
    training = toml.get("training", {})
    ac = toml.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    if mode not in AC_MODES or (mode == "selective" and not option.isdigit()):
        raise ConfigError(
            f"activation_checkpoint mode {mode!r} / selective_ac_option {option!r}: the plan "
            "models none, full and layer-selective (a digit) checkpointing"
        )
    seq_len = training.get("seq_len", 2048)
    loss_chunk = _field(toml, "training", "loss_chunk", int, 0, lambda n: n >= 0,
                        "an integer >= 0 (0: full logits)")
    offload = _field(toml, "training", "activation_offload", bool, False,
                     lambda on: not on or mode == "full",
                     "true (with activation_checkpoint.mode = 'full') or false")
    cp = _field(toml, "parallelism", "context_parallel_degree", int, 1,
                lambda n: n >= 1 and not seq_len % (n * KDA_CHUNK_SIZE)
                and (n == 1 or not args.seq_segment),
                f"an integer >= 1 with seq_len a multiple of it x {KDA_CHUNK_SIZE}, 1 with "
                "titan_moe.seq_segment > 0")
    return PlanConfig(args, seq_len, training.get("local_batch_size", 8), mode, option,
                      loss_chunk, offload, cp)
