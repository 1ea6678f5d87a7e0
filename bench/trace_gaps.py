"""Where a step's GPU sits idle: the gaps between kernels in a torch.profiler chrome trace.

    python bench/trace_gaps.py trace-text-compiled-passes.json.gz [--top 20] [--min-us 20]

The trace is the one `bench/step.py --profile trace` writes (one step). Kernels, copies and
memsets are put on one timeline (every stream together: the GPU is idle only when no stream runs
anything); a gap is the time between the end of everything before and the next start. For each
gap it prints the kernel before and after, the host ops around the launch of the kernel after it
(the outermost and innermost `cpu_op`: which module or custom op the host was in) and any
synchronising runtime call the host made during the gap (cudaStreamSynchronize, a device-to-host
copy, ...), which is what makes the GPU wait for the host. Then the idle time summed by that
launching op, so that a per-layer cost shows as one line with its count.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # what keeps the GPU busy
SYNC_CALLS = ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent", "cudaEventSynchronize")


@dataclass(frozen=True)
class Gap:
    start_us: float  # from the first kernel's start
    us: float
    before: str
    after: str
    launched_by: str
    syncs: tuple[str, ...]


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _spans(events: list[dict], category: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == category]


def _enclosing(ops: list[dict], at_us: float, tid) -> str:
    """"outermost > innermost" cpu_op of thread tid around at_us (the module or custom op being
    run, and the op that launched)."""
    around = sorted((o for o in ops
                     if o.get("tid") == tid and o["ts"] <= at_us <= o["ts"] + o["dur"]),
                    key=lambda o: -o["dur"])
    if not around:
        return "?"
    names = [around[0]["name"], around[-1]["name"]]
    return names[0] if len(around) == 1 else " > ".join(names)


def find_gaps(events: list[dict], min_us: float = 0.0) -> tuple[list[Gap], float, float]:
    """(the gaps of at least min_us, longest first; the kernels' busy time; the span from the
    first kernel's start to the last one's end), all in microseconds."""
    device = [e for c in DEVICE_WORK for e in _spans(events, c)]
    kernels = sorted(device, key=lambda e: e["ts"])
    if not kernels:
        return [], 0.0, 0.0
    runtime = _spans(events, "cuda_runtime")
    ops = _spans(events, "cpu_op")
    launch_of = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    first = kernels[0]["ts"]
    gaps, busy, end, before = [], 0.0, first, ""
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        if start - end >= max(min_us, 1e-9):
            launch = launch_of.get(k.get("args", {}).get("correlation"))
            by = _enclosing(ops, launch["ts"], launch.get("tid")) if launch else "?"
            syncs = tuple(sorted({r["name"] for r in runtime
                                  if r["ts"] < start and r["ts"] + r["dur"] > end
                                  and any(c in r["name"] for c in SYNC_CALLS)}))
            gaps.append(Gap(end - first, start - end, before, k["name"], by, syncs))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, k["name"]
    span = end - first
    return sorted(gaps, key=lambda g: -g.us), busy, span


def idle_by_launcher(gaps: list[Gap]) -> list[tuple[str, float, int]]:
    """(launching op, idle us, gaps), largest first."""
    total: dict[str, list[float]] = defaultdict(list)
    for g in gaps:
        total[g.launched_by].append(g.us)
    return sorted(((k, sum(v), len(v)) for k, v in total.items()), key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--min-us", type=float, default=20.0,
                        help="shorter gaps are left out of the list and of the idle sum")
    opts = parser.parse_args(argv)
    gaps, busy, span = find_gaps(load_events(opts.trace), opts.min_us)
    idle = sum(g.us for g in gaps)
    print(f"kernels span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
          f"idle in gaps >= {opts.min_us:g} us: {idle / 1e3:.2f} ms in {len(gaps)} gaps")
    print(f"largest {opts.top} gaps:")
    for g in gaps[: opts.top]:
        sync = f"  sync: {', '.join(g.syncs)}" if g.syncs else ""
        print(f"  {g.us / 1e3:8.3f} ms at +{g.start_us / 1e3:8.2f} ms  launched by "
              f"{g.launched_by[:40]:40}  after {g.before[:30]}, before {g.after[:30]}{sync}")
    print("idle by launching op:")
    for name, us, n in idle_by_launcher(gaps)[: opts.top]:
        print(f"  {us / 1e3:8.3f} ms  x{n:<4} {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
