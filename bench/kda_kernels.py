"""Each KDA Triton kernel alone, at each launch setting: warps, pipeline stages, GEMM operands.

    python bench/kda_kernels.py                          # H200: (1, 8192, 16, 128), 2/4/8 warps,
                                                         # 2/3 stages, bf16 and tf32 operands
    python bench/kda_kernels.py --warps 4 --stages 2     # one setting
    python bench/kda_kernels.py --device cpu --shape 1,128,1,32 --iters 1  # interpreter smoke run

One forward and backward of the op (`chunk_kda_fwd` and the backward as autograd runs them, g
given, packed documents) records every kernel launch with its real arguments; then each launch
runs again alone under every setting, timed with CUDA events (median of --iters after a warm-up
call that compiles it). A launch's time does not depend on the values it reads, so the scans,
which update their buffers in place, are timed on whatever the previous launch left. Prints
launch x setting (ms, * the op's own, + the fastest) and the op's total at its own settings
against the total of each launch's fastest; writes JSON. Settings that do not compile or
launch (registers or shared memory past the SM's) are a cell that says so.
"""

import argparse
import importlib
import itertools
import sys
from pathlib import Path

import torch
import triton
from kda import inputs
from kda_compile import forward_backward
from report import write_json
from timing import event_timed
from triton_static import recorded_launches

from titan_moe.cli_args import positive, positive_ints

# The package exports the triton_ops under their modules' names: import the module by its path.
chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")


def op_launches(shape: tuple[int, int, int, int], device: str, docs: bool) -> list[dict]:
    """Every launch of one forward+backward, each {name, row, kernel, grid, args, kwargs}; the
    launches run as they are recorded, so each one's inputs hold real values."""
    b, t, h, d = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, g, beta = (x.detach() for x in inputs(b, t, h, d, device, dtype, fused=False))
    doc = (torch.arange(t, device=device) // max(t // 3, 1)).int().expand(b, -1).contiguous()
    common = (q, k, v, g, beta, doc if docs else None, None, None, None)
    records = recorded_launches(chunk_triton, lambda: forward_backward(common, d), launch=True)
    launches, seen = [], {}
    for kernel, grid, args, kwargs in records:  # a kernel launched twice is two rows
        name = kernel.fn.__name__
        seen[name] = seen.get(name, 0) + 1
        launches.append({"name": name, "row": f"{name}#{seen[name]}", "kernel": kernel,
                         "grid": grid, "args": args, "kwargs": kwargs})
    return launches


def has_operand(launch: dict) -> bool:
    """Whether the launch takes bf16 GEMM operands that tf32 (fp32 operands) can replace."""
    return launch["kwargs"].get("OPERAND") in ("bf16", "bf16_emulated", "tf32")


def settings(launch: dict, warps: list[int], stages: list[int], operands: list[str]) -> list[dict]:
    """The settings a launch is timed at: warps x stages, and x operands where it has any."""
    operands = operands if has_operand(launch) else ["-"]
    if "STAGES" in launch["kwargs"]:
        # The forward scan at 8 warps and 1 stage hit an illegal memory access on the H100
        # (2026-12-05, unexplained), which ends every later launch of the process.
        stages = [s for s in stages if s > 1]
    return [{"num_warps": w, "num_stages": s, "operand": o}
            for o, w, s in itertools.product(operands, warps, stages)]


def timed_launch(launch: dict, setting: dict, device: str, iters: int) -> float | str:
    """Median ms of the launch under `setting`, or why it could not run."""
    kwargs = dict(launch["kwargs"], num_warps=setting["num_warps"],
                  num_stages=setting["num_stages"])
    if "STAGES" in kwargs:  # the scans' chunk loops take their depth as a constexpr
        kwargs["STAGES"] = setting["num_stages"]
    if setting["operand"] == "tf32":
        kwargs["OPERAND"] = "tf32"
    elif setting["operand"] == "bf16":
        kwargs["OPERAND"] = "bf16_emulated" if triton.knobs.runtime.interpret else "bf16"
    kernel, grid, args = launch["kernel"], launch["grid"], launch["args"]
    try:
        return event_timed(lambda: kernel[grid](*args, **kwargs), device, 1, iters)
    except Exception as error:  # out of resources, a failed compile: the cell says which
        return f"{type(error).__name__}"[:16]


def own_setting(launch: dict) -> dict:
    """The op's own launch: its warps, its scan depth, its num_stages or Triton's default 3,
    its operands."""
    operand = "-"
    if has_operand(launch):
        operand = "tf32" if launch["kwargs"]["OPERAND"] == "tf32" else "bf16"
    return {"num_warps": launch["kwargs"]["num_warps"],
            "num_stages": launch["kwargs"].get("STAGES", launch["kwargs"].get("num_stages", 3)),
            "operand": operand}


def label(setting: dict) -> str:
    return f"{setting['operand']} w{setting['num_warps']} s{setting['num_stages']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=positive_ints, default=[1, 8192, 16, 128],
                        help="B,T,H,D")
    parser.add_argument("--warps", type=positive_ints, default=[2, 4, 8])
    # Not 1 by default: two kernels ended in an illegal memory access at one stage on the H100
    # (2026-12-05), which loses the CUDA context and with it every later launch's timing.
    parser.add_argument("--stages", type=positive_ints, default=[2, 3])
    parser.add_argument("--operands", nargs="+", choices=("bf16", "tf32"),
                        default=["bf16", "tf32"])
    parser.add_argument("--no-docs", action="store_true", help="one document a row")
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--out", default="kda_kernels.json")
    opts = parser.parse_args(argv)
    if len(opts.shape) != 4:
        parser.error(f"--shape takes B,T,H,D, got {opts.shape}")
    if opts.device == "cpu" and not triton.knobs.runtime.interpret:
        parser.error("--device cpu runs the kernels under TRITON_INTERPRET=1 only")
    launches = op_launches(tuple(opts.shape), opts.device, not opts.no_docs)
    rows = []
    for launch in launches:
        times = {label(s): timed_launch(launch, s, opts.device, opts.iters)
                 for s in settings(launch, opts.warps, opts.stages, opts.operands)}
        own = label(own_setting(launch))
        own_ms = times[own] if own in times else timed_launch(launch, own_setting(launch),
                                                              opts.device, opts.iters)
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get) if ok else None
        rows.append({"launch": launch["row"], "own": own, "own_ms": own_ms, "best": best,
                     "best_ms": ok.get(best), "ms": times})
        cells = "  ".join(f"{k}:{v:.3f}" + ("*" if k == own else "+" if k == best else " ")
                          if isinstance(v, float) else f"{k}:{v}" for k, v in times.items())
        print(f"{launch['row']:<28} {cells}", flush=True)
        if "AcceleratorError" in times.values():
            print(f"stopped after {launch['row']}: a launch lost the CUDA context, so no later "
                  "launch can run in this process; rerun without the setting that failed")
            break
    total_own = sum(r["own_ms"] for r in rows if isinstance(r["own_ms"], float))
    total_best = sum(r["best_ms"] for r in rows if r["best_ms"] is not None)
    print(f"one forward+backward at {tuple(opts.shape)}: {total_own:.3f} ms at the op's own "
          f"settings, {total_best:.3f} ms with each launch at its fastest (kernels only)")
    for r in rows:
        print(f"  {r['launch']:<28} own {r['own']} {r['own_ms']:.3f} ms -> best {r['best']} "
              f"{r['best_ms']:.3f} ms" if isinstance(r["own_ms"], float) and r["best"] else
              f"  {r['launch']:<28} {r['own_ms']}")
    write_json(Path(opts.out), opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
