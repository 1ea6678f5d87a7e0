"""Training-step time and MFU: eager vs compiled vs compiled with our Inductor passes, on text and
on the multimodal batch (vision tower included), against torchtitan's own DeepSeek-V3 on text.

    python bench/step.py                       # H200: proxy flavor (+ proxy tower), bf16 autocast
    python bench/step.py --smoke               # CPU: tiny debug-flavor model, fp32, one step each

Each row times one AdamW step of a freshly built, seeded model (forward, cross entropy, backward,
optimizer; median of --iters after --warmup, the first of which compiles and is reported as
first_step_s). The compiled modes
compile as training does (titan_moe/parallel/parallelize.py's apply_compile: per sublayer and ViT
block, fullgraph): `compiled` with compile.passes = [], `compiled+passes` with every pass,
`compiled+cudagraphs` with every pass and compile.cudagraphs (CUDA graphs, CUDA only).
`torchtitan` (text, proxy flavor or --smoke) is the anchor: torchtitan 0.2.2's deepseek_v3 at the
proxy's widths (toy widths under --smoke), compiled per block as torchtitan compiles it
(bench/anchor_deepseek.py), same step and tokens, TFLOPS by torchtitan's own FLOP count. Text
rows feed --batch windows of --seq-len random tokens with a document boundary every --doc-len
tokens; multimodal rows feed windows packed by the training packer (data/multimodal.py) from
documents of one random image (sides drawn from --min-side..--max-side pixels, so dynamic
resolution and the patch budget are exercised) and a caption, and also report image patches/s
(real patches, not empty slots). TFLOPS by model/flops.py (the tower counted
per window of patch slots), MFU against --peak-tflops (CUDA only), and "host ms": how long the
host takes to issue a step started on an idle GPU (timing.host_issue_ms; near the step's time,
the step is host-bound). Prints a table, the speed-up of each compiled mode over eager, and
writes JSON (--out). A row that runs out of device memory, or fails, stays in the table as such
and the rows after it still run; the exit status is 1 if a row failed other than by memory.
"""

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
import traceback
from pathlib import Path

import anchor_deepseek
import torch
import torch.nn.functional as F
from report import write_json
from timing import device_profile, host_issue_ms, timed
from torch._dynamo.utils import counters

from compile_passes.registry import COUNTER, PASS_NAMES, matched_counts
from titan_moe.cli_args import non_negative, positive, positive_float
from titan_moe.data.multimodal import MultimodalPacker, batch_item, encode_document
from titan_moe.data.tokenizer import FLAVOR_VOCAB_SIZE, TitanTokenizer, asset_path
from titan_moe.model.args import TitanMoEArgs, get_flavor
from titan_moe.model.flops import flops_per_token
from titan_moe.model.model import TitanMoE
from titan_moe.ops.kda import KDA_BACKENDS, resolve_backend
from titan_moe.parallel.parallelize import apply_compile

# mode: (compile.passes, compile.cudagraphs); None: eager.
MODES = {"eager": None, "compiled": ([], False), "compiled+passes": (list(PASS_NAMES), False),
         "compiled+cudagraphs": (list(PASS_NAMES), True)}
ANCHOR = "torchtitan"
H200_BF16_DENSE_TFLOPS = 989.0


def _print_kernels(kernels: list[dict]) -> None:
    for e in kernels:
        print(f"  {e['ms']:8.2f} ms {100 * e['share']:5.1f}%  x{e['calls']:<4} {e['kernel'][:80]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: debug flavor cut to 2 layers "
                        "at toy width, seq 64, batch 2, one timed step per row")
    parser.add_argument("--flavor", default="proxy", choices=("debug", "proxy"))
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--batch", type=positive, default=1)
    parser.add_argument("--doc-len", type=positive, default=2048,
                        help="text rows: tokens a document")
    parser.add_argument("--modes", nargs="+", default=[*MODES, ANCHOR], choices=[*MODES, ANCHOR],
                        help=f"{ANCHOR}: text rows only, proxy flavor or --smoke")
    parser.add_argument("--inputs", nargs="+", default=["text", "multimodal"],
                        choices=("text", "multimodal"))
    parser.add_argument("--min-side", type=positive, default=112, help="multimodal: image side, px")
    parser.add_argument("--max-side", type=positive, default=896)
    parser.add_argument("--warmup", type=non_negative, default=2)
    parser.add_argument("--iters", type=positive, default=5)
    parser.add_argument("--peak-tflops", type=positive_float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--kda-backend", default="auto", choices=KDA_BACKENDS,
                        help="CUDA kernels of the KDA layers (titan_moe.kda_backend)")
    parser.add_argument("--profile", nargs="?", const="table", choices=("table", "trace"),
                        help="CUDA: device time of one step per row by kernel class, the --top "
                        "largest kernels overall and in each class; 'trace' also writes its "
                        "chrome trace beside --out (trace-<inputs>-<mode, + as ->.json.gz)")
    parser.add_argument("--top", type=positive, default=15,
                        help="--profile: how many of the largest kernels to list, overall and "
                        "in each class")
    parser.add_argument("--out", type=Path, default=Path("step.json"))
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.flavor, opts.seq_len, opts.batch, opts.doc_len = "debug", 64, 2, 40
        opts.min_side, opts.max_side, opts.warmup, opts.iters = 28, 56, 1, 1
    if opts.seq_len % 64:
        parser.error(f"--seq-len must be a multiple of the KDA chunk 64, got {opts.seq_len}")
    if opts.doc_len < 1:
        parser.error(f"--doc-len must be >= 1, got {opts.doc_len}")
    if opts.flavor != "proxy" and not opts.smoke and ANCHOR in opts.modes:
        opts.modes.remove(ANCHOR)  # the anchor exists at proxy (and smoke) widths only
    return opts


def model_args(opts, vision: bool) -> TitanMoEArgs:
    args = dataclasses.replace(get_flavor(opts.flavor), max_seq_len=opts.seq_len,
                               vision=opts.flavor if vision else "none",
                               kda_backend=opts.kda_backend)
    if opts.smoke:  # toy widths: the cold CPU compile of each layer stays in seconds
        args = dataclasses.replace(
            args, dim=32, n_layers=2, mla_layers=(2,), dense_hidden=64, head_dim=16,
            kda_gate_rank=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_experts=8, shared_hidden=16, latent_dim=16,
            expert_hidden=16, qb_bins=64, vision_max_patches=16 if vision else 0)
    return args.validate()


def text_batch(opts, vocab: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (opts.batch, opts.seq_len), generator=g)
    doc_ids = (torch.arange(opts.seq_len) // opts.doc_len).expand(opts.batch, -1)
    return {"input": tokens.to(device), "doc_ids": doc_ids.contiguous().to(device)}


def multimodal_batch(opts, tokenizer, vision, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    packer = MultimodalPacker(opts.seq_len, vision, tokenizer.pad_id)
    windows = []
    while len(windows) < opts.batch:
        h, w = torch.randint(opts.min_side, opts.max_side + 1, (2,), generator=g).tolist()
        image = torch.rand(3, h, w, generator=g)
        document = encode_document([image, f"a random picture of {h} by {w} pixels"], tokenizer,
                                   vision)
        windows += [batch_item(x, tokenizer.image_id)[0] for x in packer.add(document)]
    return {k: torch.stack([x[k] for x in windows[: opts.batch]]).to(device)
            for k in windows[0]}


def bench_one(opts, inputs: str, mode: str, device: str) -> dict:
    args = model_args(opts, inputs == "multimodal")
    if inputs == "multimodal":
        tokenizer = TitanTokenizer(asset_path(FLAVOR_VOCAB_SIZE[opts.flavor]))
        batch = multimodal_batch(opts, tokenizer, args.vision_config(), device)
    else:
        batch = text_batch(opts, args.vocab_size, device)
    labels = torch.roll(batch["input"], -1, dims=1)
    image_inputs = ([batch["patches"], batch["patch_pos"], batch["patch_image"]]
                    if inputs == "multimodal" else [])
    # (compile.passes, compile.cudagraphs) of our compiled modes; None for eager and the anchor.
    compiled = MODES.get(mode)
    graphed = compiled is not None and compiled[1] and device == "cuda"
    torch.manual_seed(0)
    if mode == ANCHOR:
        model, flops = anchor_deepseek.build(opts.seq_len, args.vocab_size, device, opts.smoke)
        model_inputs = [batch["input"]]
    else:
        with torch.device(device):
            model = TitanMoE(args)
        model.init_weights()
        if compiled is not None:
            apply_compile(model, "inductor", set(), passes=compiled[0], cudagraphs=graphed)
        flops = flops_per_token(args, opts.seq_len)
        model_inputs = [batch["input"], batch["doc_ids"], *image_inputs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def step() -> None:
        if graphed:  # the last step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            logits = model(*model_inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    counters[COUNTER].clear()
    counters["inductor"].clear()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()  # the first step: compiles in the compiled modes
    if device == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    passes_matched = matched_counts() if compiled is not None and compiled[0] else {}
    ms = timed(step, device, max(opts.warmup - 1, 0), opts.iters)
    host_ms = host_issue_ms(step, device, opts.iters)
    trace = (opts.out.parent / f"trace-{inputs}-{mode.replace('+', '-')}.json.gz"
             if opts.profile == "trace" else None)
    profile = (device_profile(step, ms, top=opts.top, trace=trace)
               if opts.profile and device == "cuda" else {})
    n_tokens = batch["input"].numel()
    n_patches = int((batch["patch_image"] >= 0).sum()) if inputs == "multimodal" else 0
    tflops = flops * n_tokens / (ms * 1e-3) / 1e12
    return {
        "inputs": inputs, "mode": mode, "flavor": opts.flavor, "device": device,
        "kda_backend": resolve_backend(opts.kda_backend) if mode != ANCHOR else None,
        "batch": opts.batch, "seq_len": opts.seq_len, "ms": ms, "host_ms": host_ms,
        "first_step_s": first_step_s,
        "tokens_per_s": n_tokens / (ms * 1e-3), "image_patches": n_patches,
        "patches_per_s": n_patches / (ms * 1e-3), "tflops": tflops,
        "mfu_pct": 100 * tflops / opts.peak_tflops if device == "cuda" else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "passes_matched": passes_matched, "profile": profile,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] if graphed else None,
    }


def failed_row(opts, inputs: str, mode: str, device: str, error: Exception) -> dict:
    """The row of a mode that did not run: out of device memory (a result at this batch size) or
    an error (a defect); no timings, the error's first line."""
    oom = isinstance(error, torch.OutOfMemoryError)
    first = str(error).splitlines()[0] if str(error) else ""
    return {"inputs": inputs, "mode": mode, "flavor": opts.flavor, "device": device,
            "batch": opts.batch, "seq_len": opts.seq_len, "ms": None, "out_of_memory": oom,
            "failure": first if oom else f"{type(error).__name__}: {first}",
            "passes_matched": {}, "profile": {}}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    device = "cpu" if opts.smoke or not torch.cuda.is_available() else "cuda"
    rows = []
    for inputs in opts.inputs:
        for mode in opts.modes:
            if mode == ANCHOR and inputs != "text":
                continue  # a text-only model
            try:
                with (anchor_deepseek.row_scope(device) if mode == ANCHOR
                      else contextlib.nullcontext()):
                    rows.append(bench_one(opts, inputs, mode, device))
            except Exception as error:
                # A row past the device's memory (eager at a large batch) is a result, and a row
                # that fails is a defect to report: either way the table says so and the rows
                # after it still run.
                if not isinstance(error, torch.OutOfMemoryError):
                    traceback.print_exc()
                rows.append(failed_row(opts, inputs, mode, device, error))
                gc.collect()
            r = rows[-1]
            if r["ms"] is None:
                what = f"out of memory at batch {opts.batch}" if r["out_of_memory"] else "failed"
                print(f"done: {inputs} {mode} {what}: {r['failure']}", flush=True)
            else:
                skips = r["cudagraph_skips"]
                skips = "" if skips is None else f", cudagraph skips {skips}"
                print(f"done: {inputs} {mode} {r['ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['tflops']:.1f} TFLOPS, first step {r['first_step_s']:.0f} s{skips}",
                      flush=True)
            write_json(opts.out, opts, rows)  # a row kept even if a later row is cut short
            if device == "cuda":
                torch.cuda.empty_cache()  # the row's model and optimizer are gone: free them
    eager_ms = {r["inputs"]: r["ms"] for r in rows if r["mode"] == "eager" and r["ms"]}
    for r in rows:
        r["speedup_vs_eager"] = (eager_ms[r["inputs"]] / r["ms"]
                                 if r["inputs"] in eager_ms and r["ms"] else None)
    print(f"{'inputs':<11} {'mode':<20} {'ms':>9} {'host ms':>8} {'tok/s':>10} {'patch/s':>10} "
          f"{'TFLOPS':>8} {'MFU%':>6} {'x eager':>7} {'GiB':>6}")
    for r in rows:
        if r["ms"] is None:
            what = "out of memory" if r["out_of_memory"] else "failed"
            print(f"{r['inputs']:<11} {r['mode']:<20} {what}: {r['failure'][:80]}")
            continue
        mfu = f"{r['mfu_pct']:6.1f}" if r["mfu_pct"] is not None else "     -"
        speedup = f"{r['speedup_vs_eager']:7.2f}" if r["speedup_vs_eager"] else "      -"
        mem = f"{r['peak_mem_gib']:6.1f}" if r["peak_mem_gib"] is not None else "     -"
        print(f"{r['inputs']:<11} {r['mode']:<20} {r['ms']:9.1f} {r['host_ms']:8.1f} "
              f"{r['tokens_per_s']:10.0f} {r['patches_per_s']:10.0f} {r['tflops']:8.3f} {mfu} "
              f"{speedup} {mem}")
    for r in rows:
        if r["passes_matched"]:
            print(f"pattern matches, {r['inputs']} {r['mode']}: {r['passes_matched']}")
        if r["profile"]:
            print(f"device time by class, {r['inputs']} {r['mode']} ({r['ms']:.1f} ms a step):")
            for c in r["profile"]["by_class"]:
                print(f"  {c['ms']:8.2f} ms {100 * c['share']:5.1f}%  {c['class']}")
            print(f"top device time, {r['inputs']} {r['mode']}:")
            _print_kernels(r["profile"]["top"])
            for c in r["profile"]["by_class"][:3]:
                print(f"top of class {c['class']}:")
                _print_kernels(c["top"])
    write_json(opts.out, opts, rows)
    return int(any(r["ms"] is None and not r["out_of_memory"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
