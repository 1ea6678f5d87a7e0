"""MoE benchmark: our LatentMoE layer against torchtitan 0.2.2's MoE.

    python bench/moe.py                         # H200: the shapes of the QB routing issue
    python bench/moe.py --tiny                  # smoke run at tiny shapes (CPU)

For each shape (d, expert hidden, E, top-k) and T tokens it times forward and forward+backward,
eager and compiled, and with --graphs compiled with CUDA graphs as training runs the layer
(mode "reduce-overhead": no host time between kernels) (median of --iters after --warmup), for:
  titan_moe  LatentMoE with latent width = d (so its experts have torchtitan's shapes), one shared
             expert of the same hidden width, the QB histogram on;
  torchtitan torchtitan.models.moe.MoE (token-choice sigmoid router, grouped experts, one shared).
Each layer compiles as its trainer compiles it: ours with our Inductor passes (--passes, by default
those `compile.passes` installs), torchtitan's with none. --inductor KEY=VALUE gives our layer's
compiles an Inductor option as `compile.inductor` gives the trainer's (e.g. combo_kernels=true,
cpp_wrapper=true), to measure it before a config turns it on. With --rounds R both layers of a
shape and mode are built at once and timed in turn, R times; a row is the median of its rounds,
their spread printed and kept: host-bound compiled rows (d 512, H100) vary by about 5% between
processes, as much as the gap between the layers.
The last default shape, d = ℓ = 3584, expert width 3072, k = 16, is K3's expert GEMMs with
E = 384 experts on one GPU (K3's 896 do not fit with their gradients: 2 x 59 GB in bf16).
Prints a table and writes JSON (--out); --profile N adds each row's N largest kernels of one
forward+backward by device time (where ours loses to torchtitan's), its device time by kernel
class with the idle rest, and the host's time to issue it (close to the f+b time: the row is
host-bound, and fewer launches or CUDA graphs pay, not faster kernels); --trace also writes that
call's chrome trace, whose host side bench/trace_host.py reads. torchtitan's MoE is timed
on CUDA only: its router calls torch.histc on int64, which has no CPU kernel.
The router alone: bench/qb_route.py.
"""

import argparse
import gc
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from report import environment
from timing import device_profile, host_issue_ms, timed
from torchtitan.models.moe.moe import MoE, MoEArgs

from compile_passes.inductor_settings import inductor_settings
from compile_passes.registry import PASS_NAMES, check_pass_names, inductor_options
from titan_moe.cli_args import non_negative, positive
from titan_moe.model.moe import LatentMoE

ISSUE_SHAPES = "512,256,128,4;2048,768,128,8;3584,3072,128,16;2048,768,64,8;3584,3072,384,16"
# torch.compile's mode for each compiled row.
COMPILE_MODES = {"compiled": None, "graphed": "reduce-overhead"}
TINY = {"tokens": 64, "shapes": "32,16,8,2", "warmup": 1, "iters": 2}


def build(kind: str, d: int, hidden: int, experts: int, k: int, device: str, dtype: torch.dtype):
    if kind == "titan_moe":
        layer = LatentMoE(dim=d, n_experts=experts, top_k=k, n_shared=1, latent_dim=d,
                          expert_hidden=hidden, shared_hidden=hidden)
        layer.init_weights(0.02, 0.02)
    else:
        args = MoEArgs(num_experts=experts, num_shared_experts=1, score_func="sigmoid",
                       route_norm=True, top_k=k, load_balance_coeff=None)
        layer = MoE(args, dim=d, hidden_dim=hidden)
        with torch.no_grad():
            layer.init_weights(0.02, torch.device(device))
    layer = layer.to(device=device, dtype=dtype)
    if kind == "titan_moe":
        layer.router.float()  # the spec keeps the router in fp32
    return layer.train()


def compiled(layer, kind: str, mode: str, passes: list[str], extra: dict | None = None):
    """torch.compile of the layer in a compiled row's mode; our passes and the extra Inductor
    options on our layer only."""
    mode_name = COMPILE_MODES[mode]
    options = {} if mode_name is None else dict(torch._inductor.list_mode_options(mode_name))
    if kind == "titan_moe":
        options.update(inductor_options(passes))
        options.update(extra or {})
    return torch.compile(layer, options=options)


def prepare(kind, shape, tokens, device, dtype, mode, passes,
            extra: dict | None = None) -> tuple[Callable, Callable]:
    """(forward, forward+backward) calls of a fresh layer, compiled in the row's mode."""
    d, hidden, experts, k = shape
    layer = build(kind, d, hidden, experts, k, device, dtype)
    fn = layer if mode == "eager" else compiled(layer, kind, mode, passes, extra)
    x = torch.randn(1, tokens, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    leaves = [x, *(p for p in layer.parameters() if p.requires_grad)]

    def fwd():
        torch.compiler.cudagraph_mark_step_begin()  # each call is a new step for CUDA graphs
        with torch.no_grad():
            return fn(x)

    def fwd_bwd():
        # The gradients are returned, as a step after zero_grad(set_to_none=True) stores them:
        # accumulated into .grad, the next CUDA-graph replay would overwrite the tensor that the
        # accumulation then reads ("accessing tensor output of CUDAGraphs that has been
        # overwritten", on x's gradient), and both layers would pay an add per parameter.
        torch.compiler.cudagraph_mark_step_begin()
        torch.autograd.grad(fn(x), leaves, grad, allow_unused=True)

    return fwd, fwd_bwd


def time_rounds(calls: dict[str, tuple[Callable, Callable]], device: str, warmup: int,
                iters: int, rounds: int) -> dict[str, dict]:
    """Each round times every layer in turn (forward, then forward+backward), so a drift in the
    machine's speed during the run falls on every layer alike. A layer's figure is the median
    over rounds of each round's median; with rounds > 1 the rounds' figures are kept too."""
    times = {kind: {"fwd_ms": [], "fwd_bwd_ms": []} for kind in calls}
    # Python's collector off while timing, as torchtitan's trainer runs (training.gc_freq: it
    # collects every 50 steps itself): a collection inside a timed call of a host-bound row
    # would add milliseconds to one layer's round and not the other's.
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for kind, (fwd, fwd_bwd) in calls.items():
                times[kind]["fwd_ms"].append(timed(fwd, device, warmup, iters))
                times[kind]["fwd_bwd_ms"].append(timed(fwd_bwd, device, warmup, iters))
    finally:
        gc.enable()
    rows = {}
    for kind, t in times.items():
        rows[kind] = {key: statistics.median(values) for key, values in t.items()}
        if rounds > 1:
            rows[kind].update({f"{key}_rounds": values for key, values in t.items()})
    return rows


def profiled(fwd_bwd: Callable, fwd_bwd_ms: float, device: str, iters: int, top: int,
             trace: Path | None = None) -> dict:
    """--profile's figures for a row: its top kernels, device time by class, host issue time;
    trace: the profiled call's chrome trace is also written there."""
    profile = device_profile(fwd_bwd, fwd_bwd_ms, top=top, trace=trace)
    return {"profile": profile["top"],
            "classes": [{k: c[k] for k in ("class", "ms", "share")} for c in profile["by_class"]],
            "host_fwd_bwd_ms": host_issue_ms(fwd_bwd, device, iters)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=positive, default=16384)
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="d,hidden,E,k;...")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=10)
    parser.add_argument("--rounds", type=positive, default=1,
                        help="time both layers of a shape and mode this many times, in turn, "
                             "both alive at once (1: one layer at a time, as memory allows)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA: also compiled with CUDA graphs (rows 'graphed')")
    parser.add_argument("--profile", type=non_negative, default=0, metavar="N",
                        help="CUDA: list each row's N largest kernels of one forward+backward")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: also write each row's profiled forward+backward as "
                             "a chrome trace beside --out (trace-moe-<layer>-<d>-<E>-<mode>"
                             ".json.gz), for bench/trace_host.py and bench/trace_gaps.py")
    parser.add_argument("--passes", nargs="*", metavar="PASS", default=list(PASS_NAMES),
                        help=f"our Inductor passes on our compiled layer ({', '.join(PASS_NAMES)});"
                             " none after the flag turns them off. Default: all, as "
                             "compile.passes installs them")
    parser.add_argument("--inductor", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="an Inductor option on our compiled layer only (repeatable)")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                       for k, v in TINY.items()))
    parser.add_argument("--out", default="bench/moe.json")
    opts = parser.parse_args()
    if opts.tiny:
        vars(opts).update(TINY)
    passes = opts.passes
    try:
        check_pass_names(passes, "--passes")
        extra = inductor_settings(opts.inductor, "--inductor")
    except ValueError as e:
        parser.error(str(e))
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    shapes = [tuple(int(v) for v in s.split(",")) for s in opts.shapes.split(";")]
    if opts.trace and not opts.profile:
        parser.error("--trace: the trace is of --profile's call; give --profile N")
    if opts.graphs and opts.device != "cuda":
        parser.error("--graphs: CUDA graphs need --device cuda")
    modes = ["eager"] + ([] if opts.no_compile else ["compiled"]) + (
        ["graphed"] if opts.graphs else [])
    # torchtitan 0.2.2's router calls torch.histc on int64, which has no CPU kernel.
    kinds = ("titan_moe", "torchtitan") if opts.device == "cuda" else ("titan_moe",)
    if opts.device != "cuda":
        print("note: torchtitan's MoE runs on CUDA only (torch.histc on int64); CPU times ours")
    rows = []
    print(f"{'layer':<11} {'d':>5} {'hidden':>6} {'E':>4} {'k':>3} {'mode':<8} "
          f"{'fwd ms':>8} {'fwd+bwd ms':>11}")
    for shape in shapes:
        for mode in modes:
            for group in ([list(kinds)] if opts.rounds > 1 else [[kind] for kind in kinds]):
                # Every group compiles its own layers: Dynamo's recompile limit (8 a code
                # object) counts the earlier groups' compiles of the same forward, and past it a
                # row silently ran eagerly (d 3584 compiled, H100, 2026-12-06).
                torch._dynamo.reset()
                calls = {kind: prepare(kind, shape, opts.tokens, opts.device, dtype, mode, passes,
                                       extra)
                         for kind in group}
                timed_rows = time_rounds(calls, opts.device, opts.warmup, opts.iters, opts.rounds)
                for kind in group:
                    r = timed_rows[kind]
                    if opts.profile and opts.device == "cuda":
                        trace = (Path(opts.out).parent /
                                 f"trace-moe-{kind}-{shape[0]}-{shape[2]}-{mode}.json.gz"
                                 if opts.trace else None)
                        r.update(profiled(calls[kind][1], r["fwd_bwd_ms"], opts.device,
                                          opts.iters, opts.profile, trace))
                    rows.append({"layer": kind, "shape": shape, "mode": mode, **r})
                    spread = (f"  (f+b rounds {min(r['fwd_bwd_ms_rounds']):.3f}"
                              f"-{max(r['fwd_bwd_ms_rounds']):.3f})" if opts.rounds > 1 else "")
                    print(f"{kind:<11} {shape[0]:>5} {shape[1]:>6} {shape[2]:>4} {shape[3]:>3} "
                          f"{mode:<8} {r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>11.3f}{spread}")
                    if "classes" in r:
                        print(f"    host issues f+b in {r['host_fwd_bwd_ms']:.3f} ms; " +
                              ", ".join(f"{c['class']} {c['ms']:.3f}" for c in r["classes"]))
                    for e in r.get("profile", []):
                        print(f"    {e['ms']:7.3f} ms {100 * e['share']:5.1f}%  x{e['calls']:<3} "
                              f"{e['kernel'][:90]}")
                del calls
                # After every group, so a run stopped by a time limit keeps the rows it timed.
                result = {**environment(), "tokens": opts.tokens, "dtype": str(dtype),
                          "titan_moe_passes": passes, "titan_moe_inductor": extra,
                          "layers": rows}
                with open(opts.out, "w") as f:
                    json.dump(result, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
