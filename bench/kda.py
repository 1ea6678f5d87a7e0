"""KDA benchmark: our `chunk_kda` against fla-core 0.6.0 (`safe_gate=True, lower_bound=-5`).

    python bench/kda.py                                   # H200: the shapes of the KDA issue
    python bench/kda.py --device cpu --shapes 1,256,2,64  # smoke run on CPU (ours only)

For each (B, T, H, D) in bf16 it times forward and forward+backward (median of --iters after
--warmup), two ways: with g given (log-decay in (-5, 0]) and with the gate fused into the kernels
(ours: `chunk_kda_fused_gate`; fla: `use_gate_in_kernel=True`). It reports TFLOP/s with Kimi
Linear's count per head, 6TD² + 3TCD + TC² for the forward (C = 64), tripled for forward+backward;
GB/s of the compulsory traffic (inputs read once, outputs written once) and that as a share of the
measured device-copy bandwidth (the roofline); the speed-up over fla; the peak memory of
forward+backward. The gradients are returned (torch.autograd.grad), not accumulated into the
inputs' .grad (until 2026-12-05 they were: five more elementwise passes, 1.05 ms of both sides' f+b
at 64K x 16 heads on the H100). --doc-len N splits every row into documents of N tokens, the
model's layout (the state restarts at each; fla's kernels then run varlen); fla's own `chunk_kda`
has no such input, so with --doc-len only our entry points run (both backends). Then
(--layer-memory) the peak memory of one proxy-sized KDA layer's forward+backward against T.
--block-v N runs ours with another V block (the state scans' split of the state, so their programs:
B·H·V/N). bench/kda_memory.py predicts the peaks on a host without a GPU. Prints tables, writes
JSON.
fla's first call at a new shape autotunes for minutes: keep ~/.triton/cache between runs.
"""

import argparse
import importlib
import json
import statistics
from collections.abc import Callable

import torch
from report import environment
from timing import copy_bandwidth, timed

from titan_moe.cli_args import non_negative, positive
from titan_moe.model.args import get_flavor
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.ops.kda import CHUNK_SIZE, chunk_kda, chunk_kda_fused_gate
from titan_moe.ops.kda.fla_backend import use_tuned_fla_configs

ISSUE_SHAPES = "1,8192,16,128;2,16384,16,128;1,8192,96,128;8,4096,32,128;1,65536,16,128"
LAYER_LENGTHS = "8192,16384,32768,65536"
G_MIN = -5.0


def forward_flops(b: int, t: int, h: int, d: int) -> float:
    return b * h * (6 * t * d * d + 3 * t * CHUNK_SIZE * d + t * CHUNK_SIZE * CHUNK_SIZE)


def compulsory_bytes(b: int, t: int, h: int, d: int, backward: bool) -> float:
    """bf16 q, k, v, g (+ beta) read and o written; backward adds dO read, 5 gradients written."""
    tensors = (4 + 1) + (1 + 4) if backward else 4 + 1
    return 2.0 * b * t * h * (tensors * d + (2 if backward else 1))


def documents(b: int, t: int, doc_len: int, device: str) -> torch.Tensor | None:
    """[B, T] document index, a new document every doc_len tokens (None for doc_len 0)."""
    if not doc_len:
        return None
    return (torch.arange(t, device=device) // doc_len).to(torch.int32).expand(b, -1).contiguous()


def inputs(b, t, h, d, device, dtype, fused):
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32, generator=gen)

    q = torch.nn.functional.normalize(rand(b, t, h, d), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rand(b, t, h, d), dim=-1).to(dtype)
    v = rand(b, t, h, d).to(dtype)
    g = rand(b, t, h, d).to(dtype) if fused else (G_MIN * torch.sigmoid(rand(b, t, h, d))).to(dtype)
    beta = torch.sigmoid(rand(b, t, h)).to(dtype)
    gate = [torch.zeros(h, device=device), rand(h * d)] if fused else []
    return [x.requires_grad_() for x in (q, k, v, g, beta, *gate)]


def bench(impl: Callable, shape, device, dtype, fused, warmup, iters, bandwidth,
          doc_len: int) -> dict:
    tensors = inputs(*shape, device, dtype, fused)
    grad = torch.randn_like(tensors[2])
    doc = {} if not doc_len else {"doc_ids": documents(shape[0], shape[1], doc_len, device)}

    def fwd():
        with torch.no_grad():
            impl(*tensors, **doc)

    def fwd_bwd():
        # The gradients are returned, not accumulated into the inputs' .grad: in a model the
        # op's inputs are activations, and an accumulation is five more passes over [B,T,H,D].
        torch.autograd.grad(impl(*tensors, **doc)[0], tensors, grad)

    fwd_ms = timed(fwd, device, warmup, iters)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fwd_bwd_ms = timed(fwd_bwd, device, warmup, iters)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    flops = forward_flops(*shape)
    gbps = compulsory_bytes(*shape, backward=True) / fwd_bwd_ms / 1e6
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
            "fwd_bwd_tflops": 3 * flops / fwd_bwd_ms / 1e9, "fwd_bwd_gbps": gbps,
            "roofline_share": gbps / bandwidth, "peak_gib": peak}


def fla_impls() -> dict[str, Callable]:
    use_tuned_fla_configs()  # before fla's first import: its config cache reads the env then
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return {}

    def plain(q, k, v, g, beta):
        return fla_chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=G_MIN)

    def fused(q, k, v, g, beta, A_log, dt_bias):
        return fla_chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=G_MIN,
                             use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    return {"fla": plain, "fla_fused": fused}


def ours_plain(q, k, v, g, beta, doc_ids=None):
    return chunk_kda(q, k, v, g, beta, doc_ids=doc_ids, backend="triton")


def ours_fused(q, k, v, g_raw, beta, A_log, dt_bias, doc_ids=None):
    return chunk_kda_fused_gate(q, k, v, g_raw, A_log, dt_bias, beta, G_MIN, doc_ids=doc_ids,
                                backend="triton")


def fla_op_fused(q, k, v, g_raw, beta, A_log, dt_bias, doc_ids=None):
    """fla's kernels through our custom ops (the model's `kda_backend = "fla"`)."""
    return chunk_kda_fused_gate(q, k, v, g_raw, A_log, dt_bias, beta, G_MIN, doc_ids=doc_ids,
                                backend="fla")


def layer_memory(lengths: list[int], device: str) -> list[dict]:
    """Peak memory of one proxy KDA layer's bf16 forward+backward at batch 1, against T."""
    torch.manual_seed(0)
    args = get_flavor("proxy")
    layer = KimiDeltaAttention(args).to(device)
    layer.init_weights(0.02, 0.02)
    rows = []
    for t in lengths:
        x = torch.randn(1, t, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append({"T": t, "peak_gib": peak, "mib_per_1k_tokens": peak * 2**10 / (t / 1024)})
        print(f"KDA layer (proxy) T={t:>7}: peak {peak:7.2f} GiB above inputs, "
              f"{rows[-1]['mib_per_1k_tokens']:7.1f} MiB per 1K tokens")
        del x, y
    return rows


def kernel_profile(impl: Callable, shape, device, dtype, fused) -> list[dict]:
    """Per-kernel device time of one forward+backward of `impl` (torch.profiler), largest first."""
    tensors = inputs(*shape, device, dtype, fused)
    grad = torch.randn_like(tensors[2])
    torch.autograd.grad(impl(*tensors)[0], tensors, grad)
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
        torch.autograd.grad(impl(*tensors)[0], tensors, grad)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(({"kernel": e.key, "calls": e.count, "ms": e.device_time_total / 1e3}
                   for e in events), key=lambda r: -r["ms"])
    print(f"kernels of one fwd+bwd at {shape}, {sum(r['ms'] for r in rows):.3f} ms in all:")
    for r in rows[:12]:
        print(f"  {r['ms']:8.3f} ms  x{r['calls']:<3} {r['kernel'][:90]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="B,T,H,D;...")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=10)
    parser.add_argument("--no-fla", action="store_true", help="time ours only")
    parser.add_argument("--doc-len", type=non_negative, default=0,
                        help="tokens a document (0: one document a row); our entry points only")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="time only these rows (titan_moe, fla, titan_moe_fused, fla_fused, "
                             "fla_op_fused)")
    parser.add_argument("--layer-memory", default=LAYER_LENGTHS,
                        help="T values for the layer memory table ('' to skip; CUDA only)")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel device times of each impl at each shape (CUDA)")
    parser.add_argument("--block-v", type=positive, default=None,
                        help="ours with this V block (a power of two, at least 32) in the state "
                             "scans and the V-parallel kernels, instead of the op's own")
    parser.add_argument("--gemms", choices=("bf16", "tf32"), default=None,
                        help="ours with these GEMM operands for bf16 inputs (chunk_triton.GEMMS; "
                             "bf16, the op's own, or tf32: fp32 operands, the op before "
                             "2026-12-05's fourteenth session)")
    parser.add_argument("--out", default="bench/kda.json")
    opts = parser.parse_args()
    if opts.block_v is not None:
        # 16 with V = 128 hit an illegal memory access on the H200 (2026-12-05), not yet found.
        if opts.block_v < 32 or opts.block_v & (opts.block_v - 1):
            parser.error(f"--block-v must be a power of two >= 32, got {opts.block_v}")
        # The module, not the function the package exports under its name.
        importlib.import_module("titan_moe.ops.kda.chunk_triton").BLOCK_V = opts.block_v
    if opts.gemms is not None:
        importlib.import_module("titan_moe.ops.kda.chunk_triton").GEMMS = opts.gemms
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    impls = {"titan_moe": (ours_plain, False), "titan_moe_fused": (ours_fused, True)}
    fla = {} if opts.device != "cuda" or opts.no_fla else fla_impls()
    if fla:
        impls = {"titan_moe": impls["titan_moe"], "fla": (fla["fla"], False),
                 "titan_moe_fused": impls["titan_moe_fused"], "fla_fused": (fla["fla_fused"], True),
                 "fla_op_fused": (fla_op_fused, True)}
    else:
        print("note: fla-core (CUDA) not used here; timing ours only")
    if opts.doc_len:  # fla's own chunk_kda takes cu_seqlens, not a [B, T] document index
        impls = {k: v for k, v in impls.items() if k not in ("fla", "fla_fused")}
    if opts.impls:
        unknown = set(opts.impls) - set(impls)
        if unknown:
            parser.error(f"--impls: {sorted(unknown)} not available here; allowed {list(impls)}")
        impls = {k: v for k, v in impls.items() if k in opts.impls}
    def save(rows, speedups=None, memory=(), profiles=None) -> None:
        result = {"environment": environment(), "dtype": str(dtype), "copy_gbps": bandwidth,
                  "doc_len": opts.doc_len, "block_v": opts.block_v,
                  "gemms": opts.gemms, "rows": rows,
                  "speedups": speedups or {}, "layer_memory": list(memory),
                  "kernel_profiles": profiles or {}}
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)

    bandwidth = copy_bandwidth(opts.device)
    print(f"measured copy bandwidth (roofline): {bandwidth:.0f} GB/s")
    rows = []
    print(f"{'impl':<16} {'B':>2} {'T':>6} {'H':>3} {'D':>4} {'fwd ms':>8} {'f+b ms':>8} "
          f"{'fwd TF/s':>9} {'f+b TF/s':>9} {'f+b GB/s':>9} {'roof':>5} {'peak GiB':>9}")
    for text in opts.shapes.split(";"):
        shape = tuple(int(v) for v in text.split(","))
        for name, (impl, fused) in impls.items():
            r = bench(impl, shape, opts.device, dtype, fused, opts.warmup, opts.iters, bandwidth,
                      opts.doc_len)
            rows.append({"impl": name, "shape": shape, **r})
            print(f"{name:<16} {shape[0]:>2} {shape[1]:>6} {shape[2]:>3} {shape[3]:>4} "
                  f"{r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>8.3f} {r['fwd_tflops']:>9.2f} "
                  f"{r['fwd_bwd_tflops']:>9.2f} {r['fwd_bwd_gbps']:>9.0f} "
                  f"{r['roofline_share']:>5.2f} {r['peak_gib']:>9.2f}", flush=True)
            save(rows)  # each row kept even if a later one (fla autotuning) runs out of time
    profiles = {}
    if opts.profile and opts.device == "cuda":
        for text in opts.shapes.split(";"):
            shape = tuple(int(v) for v in text.split(","))
            profiles[text] = {}
            for name, (impl, fused) in impls.items():
                print(f"{name}: ", end="")
                profiles[text][name] = kernel_profile(impl, shape, opts.device, dtype, fused)
    speedups = {}
    for ours, theirs in (("titan_moe", "fla"), ("titan_moe_fused", "fla_fused")):
        pairs = [(o, f) for o in rows if o["impl"] == ours for f in rows
                 if f["impl"] == theirs and f["shape"] == o["shape"]]
        if pairs:
            ratios = [f["fwd_bwd_ms"] / o["fwd_bwd_ms"] for o, f in pairs]
            speedups[ours] = {"geomean": statistics.geometric_mean(ratios), "min": min(ratios)}
            print(f"{ours} fwd+bwd speed-up over {theirs}: geometric mean "
                  f"{speedups[ours]['geomean']:.2f}x, worst shape {min(ratios):.2f}x")
    memory = []
    if opts.device == "cuda" and opts.layer_memory:
        memory = layer_memory([int(t) for t in opts.layer_memory.split(",")], opts.device)
    save(rows, speedups, memory, profiles)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
