"""Print a flavor's total and active parameter counts, built on the meta device.

    python -m titan_moe.plan.params --flavor full
    python -m titan_moe.plan.params --config configs/proxy.toml
"""

import argparse
import sys
import tomllib
from pathlib import Path

import torch

from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args
from titan_moe.model.flops import count_params, flops_per_token
from titan_moe.model.model import TitanMoE


def args_from_toml(path: Path) -> tuple[TitanMoEArgs, int]:
    """The model args and seq_len a training TOML describes ([model].flavor + [titan_moe])."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    with path.open("rb") as f:
        cfg = tomllib.load(f)
    args = model_args(cfg.get("model", {}).get("flavor", "debug"), **cfg.get("titan_moe", {}))
    return args, cfg.get("training", {}).get("seq_len", 8192)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--flavor", help="debug, proxy or full")
    group.add_argument("--config", type=Path, help="a training TOML file")
    opts = parser.parse_args(argv)
    try:
        args, seq_len = (model_args(opts.flavor), 8192) if opts.flavor else args_from_toml(
            opts.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with torch.device("meta"):
        model = TitanMoE(args)
    n = count_params(model, args)
    flops = flops_per_token(args, seq_len, n.active)
    name = opts.flavor or str(opts.config)
    print(f"{name}: {args.n_layers} layers ({args.n_layers - len(args.mla_layers)} KDA / "
          f"{len(args.mla_layers)} MLA), d={args.dim}, {args.n_experts} experts top-{args.top_k}")
    print(f"  total parameters : {n.total:>18,d}  ({_human(n.total)})")
    print(f"  active parameters: {n.active:>18,d}  ({_human(n.active)}, per token, "
          f"embedding lookup excluded)")
    print(f"  routed experts   : {n.routed_experts:>18,d}  ({_human(n.routed_experts)})")
    print(f"  embedding        : {n.embedding:>18,d}  ({_human(n.embedding)})")
    print(f"  training FLOPs/token at seq_len {seq_len}: {flops:.4g}")
    return 0


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit} parameters"
    return f"{n} parameters"


if __name__ == "__main__":
    sys.exit(main())
