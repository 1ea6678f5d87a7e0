"""Where a step's host time goes: the CPU side of a torch.profiler chrome trace.

    python bench/trace_host.py trace-text-compiled-passes.json.gz [--under NAME] [--depth 1]

The trace is the one `bench/step.py --profile trace` writes (one step). Without --under it prints,
for each host thread (the forward's and the autograd engine's), the span and the outermost
`cpu_op`s summed by name: which compiled regions, backward nodes and eager ops the host spent
the step in. With --under it sums the ops `--depth` levels below every op whose name starts with
NAME (say "titan_moe::fla_kda_fwd", or "autograd::engine::evaluate_function:
CompiledFunctionBackward" with --depth 3 for the kernels each backward launches); what the
children leave of their parent's time is Python or C++ outside any profiled op. Runtime calls
(launches, synchronisations) count as ops, so a host sync shows as its cudaStreamSynchronize;
without --under each thread's runtime calls are also summed by name, at any depth (how many
kernels it launched).
bench/trace_gaps.py reads the same trace from the GPU's side.
"""

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

from trace_gaps import load_events

HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def _threads(events: list[dict]) -> dict[tuple, list[dict]]:
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    return by_thread


def outermost(events: list[dict]) -> dict[tuple, tuple[float, Counter, Counter]]:
    """thread -> (span µs, µs by outermost cpu_op name, calls by name)."""
    result = {}
    for thread, ops in _threads(events).items():
        time, calls, end = Counter(), Counter(), float("-inf")
        for e in ops:
            if e["cat"] == "cpu_op" and e["ts"] >= end:
                time[e["name"]] += e["dur"]
                calls[e["name"]] += 1
                end = e["ts"] + e["dur"]
        span = max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]
        result[thread] = (span, time, calls)
    return result


def runtime_calls(events: list[dict]) -> dict[tuple, tuple[Counter, Counter]]:
    """thread -> (µs by CUDA runtime / driver call name, calls by name): the launches, copies
    and synchronisations a thread made, at any depth. Two steps that differ in host time but
    not in their outermost ops differ here: in how many kernels they launch."""
    result = {}
    for thread, ops in _threads(events).items():
        time, calls = Counter(), Counter()
        for e in ops:
            if e["cat"] in ("cuda_runtime", "cuda_driver"):
                time[e["name"]] += e["dur"]
                calls[e["name"]] += 1
        result[thread] = (time, calls)
    return result


def under(events: list[dict], prefix: str, depth: int = 1) -> tuple[int, float, Counter, Counter]:
    """(calls of the ops named prefix..., their µs, µs and calls by the name of the ops `depth`
    levels below them). An op nested in another op of the prefix counts under the outer one."""
    n, total, time, calls = 0, 0.0, Counter(), Counter()
    for ops in _threads(events).values():
        stack: list[dict] = []
        for e in ops:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            top = next((i for i, s in enumerate(stack) if s["name"].startswith(prefix)), None)
            if top is None and e["name"].startswith(prefix):
                n, total = n + 1, total + e["dur"]
            elif top is not None and len(stack) - top == depth:
                time[e["name"]] += e["dur"]
                calls[e["name"]] += 1
            stack.append(e)
    return n, total, time, calls


def _table(time: Counter, calls: Counter, top: int) -> None:
    for name, us in time.most_common(top):
        print(f"  {us / 1e3:9.2f} ms  x{calls[name]:<5} {name[:90]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--under", help="sum the ops below those whose name starts with this")
    parser.add_argument("--depth", type=int, default=1, help="--under: levels below (>= 1)")
    parser.add_argument("--top", type=int, default=15)
    opts = parser.parse_args(argv)
    if opts.depth < 1:
        parser.error(f"--depth must be >= 1, got {opts.depth}")
    events = load_events(opts.trace)
    if opts.under is None:
        runtime = runtime_calls(events)
        for thread, (span, time, calls) in outermost(events).items():
            print(f"thread {thread[1]}: span {span / 1e3:.1f} ms, in outermost ops "
                  f"{sum(time.values()) / 1e3:.1f} ms")
            _table(time, calls, opts.top)
            r_time, r_calls = runtime[thread]
            print(f"  runtime calls: {sum(r_calls.values())}, {sum(r_time.values()) / 1e3:.2f} ms")
            _table(r_time, r_calls, opts.top)
        return 0
    n, total, time, calls = under(events, opts.under, opts.depth)
    print(f"{opts.under}: {n} calls, {total / 1e3:.2f} ms; ops {opts.depth} level(s) below: "
          f"{sum(time.values()) / 1e3:.2f} ms")
    _table(time, calls, opts.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
