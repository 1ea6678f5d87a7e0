"""Write a scaled-down context-stage chain: the stage configs of configs/stages/ at shorter lengths
and a few steps each, to check the chain (resume stage to stage, the long-context evaluation in
TensorBoard) on one GPU in minutes.

    python scripts/short_stages.py --lengths 8192,16384,32768,65536 --steps 30 \
        --out outputs/short_stages
    STAGE_DIR=outputs/short_stages STAGES="8k 16k 32k 64k" scripts/run_stages.sh

Every stage takes configs/stages/64k.toml (the proxy flavor, full activation checkpointing, the
chunked loss, the long-context evaluation at its last step) with its own length, `--steps`
steps, a checkpoint at its last step and, from the second stage on, the previous stage's final
checkpoint as its starting point (model and QB biases; fresh optimizer and warm-up). Stage
names are the lengths in K (8192 -> "8k").
"""

import argparse
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "configs" / "stages" / "64k.toml"


def stage_name(seq_len: int) -> str:
    return f"{seq_len // 1024}k" if seq_len % 1024 == 0 else str(seq_len)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(config: dict[str, dict[str, object]]) -> str:
    """The configs' shape: tables of scalars and lists."""
    return "\n".join(f"[{section}]\n" + "".join(f"{key} = {toml_value(value)}\n"
                                              for key, value in table.items())
                     for section, table in config.items())


def stage_configs(lengths: list[int], steps: int, out: Path,
                  template: Path = TEMPLATE) -> dict[str, str]:
    """Stage name -> TOML text, in chain order."""
    base = tomllib.loads(template.read_text())
    texts: dict[str, str] = {}
    previous = None
    for seq_len in lengths:
        name = stage_name(seq_len)
        config = {section: dict(table) for section, table in base.items()}
        config["job"].update(dump_folder=str(out / name),
                             description=f"titan_moe proxy, short context stage {name}")
        config["training"].update(seq_len=seq_len, steps=steps,
                                  loss_chunk=min(config["training"]["loss_chunk"], seq_len))
        # Documents at least a quarter of the row, as the template's 16K of 64K.
        config["training"]["min_doc_tokens"] = seq_len // 4
        config["lr_scheduler"]["warmup_steps"] = max(1, steps // 3)
        config["metrics"] = {**config.get("metrics", {}), "log_freq": max(1, steps // 10)}
        config["checkpoint"].update(interval=steps)
        config["checkpoint"].pop("initial_load_path", None)
        config["checkpoint"].pop("initial_load_model_only", None)
        if previous is not None:
            config["checkpoint"].update(
                initial_load_path=str(out / previous / "checkpoint" / f"step-{steps}"),
                initial_load_model_only=True)
        texts[name] = to_toml(config)
        previous = name
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768,65536",
                        help="comma-separated sequence lengths, in chain order")
    parser.add_argument("--steps", type=int, default=30, help="training steps per stage")
    parser.add_argument("--out", type=Path, default=Path("outputs/short_stages"))
    opts = parser.parse_args(argv)
    lengths = [int(x) for x in opts.lengths.split(",")]
    if not lengths or any(n <= 0 for n in lengths) or lengths != sorted(set(lengths)):
        parser.error(f"--lengths must be increasing positive integers, got {opts.lengths!r}")
    if opts.steps < 1:
        parser.error(f"--steps must be >= 1, got {opts.steps}")
    opts.out.mkdir(parents=True, exist_ok=True)
    texts = stage_configs(lengths, opts.steps, opts.out)
    for name, text in texts.items():
        (opts.out / f"{name}.toml").write_text(text)
    print(f'STAGE_DIR={opts.out} STAGES="{" ".join(texts)}" scripts/run_stages.sh')
    return 0


if __name__ == "__main__":
    sys.exit(main())
