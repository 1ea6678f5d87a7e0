"""`python -m titan_moe.plan`: the memory plan of a TOML's model on FSDP2 × EP layouts
(`layouts.py`, `memory.py`), with pipeline parallelism (`pipeline.py`) for the degrees `--pp`
names.

    python -m titan_moe.plan --config configs/stages/1m.toml
    python -m titan_moe.plan --config configs/full.toml --gpus 1024 --gpu-mem 141
    python -m titan_moe.plan --config configs/full.toml --pp 1 2 4 8 16       (fewest H200s each)
    python -m titan_moe.plan --config configs/proxy.toml --validate      (one CUDA GPU)
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from titan_moe.cli_args import positive, positive_float
from titan_moe.model.args import ConfigError
from titan_moe.plan.config import PlanConfig, load_plan_config
from titan_moe.plan.layouts import print_plan
from titan_moe.plan.memory import GB
from titan_moe.plan.pipeline import SCHEDULES, fewest_gpus_with_pp, step_microbatches
from titan_moe.plan.validate import validate


def print_pipeline_plans(cfg: PlanConfig, gpu_mem_gb: float, degrees: list[int],
                         microbatch: int, microbatches: int | None, schedule: str,
                         virtual: int) -> list[dict]:
    """For each pp: the fewest GPUs whose fullest stage fits, its stages, bubble and cuts."""
    m = step_microbatches(cfg, microbatch, microbatches)
    print(f"pipeline ({schedule}, {m} micro-batches of {microbatch} x {cfg.seq_len} tokens a "
          "step): fewest GPUs with each pp degree")
    print("| pp | GPUs | EP | fullest stage | its peak GB | bubble | MiB a cut, per micro-batch "
          "| stages (layers) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for pp in degrees:
        if pp > cfg.args.n_layers:
            print(f"| {pp} | — | — | — | — | — | — | more stages than the {cfg.args.n_layers} "
                  "layers |")
            continue
        plan = fewest_gpus_with_pp(cfg, gpu_mem_gb, pp, microbatch, m, schedule, virtual)
        if plan is None:
            print(f"| {pp} | fits on none up to 65536 GPUs | | | | | | |")
            continue
        e = plan.fullest
        cuts = ", ".join(f"{b / 2**20:.0f}" for b in plan.boundary_bytes) or "—"
        stages = " ".join(f"{r.start}-{r.stop - 1}" for r in plan.stages)
        print(f"| {pp} | {e.gpus * pp} | {e.ep} | {plan.fullest_stage} | {e.peak / GB:.1f} | "
              f"{plan.bubble:.1%} | {cuts} | {stages} |")
        rows.append({"pp": pp, "gpus": e.gpus * pp, "ep": e.ep, "fullest": asdict(e),
                     "fullest_stage": plan.fullest_stage, "bubble": plan.bubble,
                     "boundary_bytes": plan.boundary_bytes,
                     "stages": [[r.start, r.stop] for r in plan.stages]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a titan_moe TOML")
    parser.add_argument("--gpus", type=positive, default=8, help="GPUs of the layouts to print")
    parser.add_argument("--gpu-mem", type=positive_float, default=141.0,
                        help="GB per GPU (H200: 141)")
    parser.add_argument("--validate", action="store_true",
                        help="measure the config's peak on one CUDA GPU against the plan")
    parser.add_argument("--steps", type=positive, default=3, help="training steps for --validate")
    parser.add_argument("--pp", type=positive, nargs="+", default=[],
                        help="pipeline degrees: the fewest GPUs with each")
    parser.add_argument("--microbatch", type=positive, default=1,
                        help="pipeline micro-batch, rows")
    parser.add_argument("--microbatches", type=positive,
                        help="pipeline micro-batches a step (default: local_batch_size / "
                        "--microbatch)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--virtual", type=positive, default=2,
                        help="Interleaved1F1B: stages a rank")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    ns = parser.parse_args(argv)
    try:
        cfg = load_plan_config(ns.config)
    except (OSError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.validate:
        result = validate(cfg, ns.steps)
        ok = 0.85 <= result["ratio"] <= 1.15
    else:
        result = {"layouts": [asdict(e) for e in print_plan(cfg, ns.gpus, ns.gpu_mem)]}
        if ns.pp:
            result["pipeline"] = print_pipeline_plans(cfg, ns.gpu_mem, ns.pp, ns.microbatch,
                                                      ns.microbatches, ns.schedule, ns.virtual)
        ok = True
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
