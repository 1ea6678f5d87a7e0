"""Multimodal training step: the proxy flavor with its vision tower, against the same step on text.

    python bench/vision_step.py                      # H200: proxy + proxy tower, bf16 autocast
    python bench/vision_step.py --tiny               # smoke run on CPU (debug sizes, fp32)

Windows are packed by the training packer (data/multimodal.py) from documents of one random image
(sides drawn from --min-side..--max-side pixels, so dynamic resolution and the patch budget are
exercised) and a caption, until --batch windows are full. Each row times one AdamW step
(forward, backward, optimizer; median of --iters after --warmup): `multimodal` feeds the patch
slots through the tower, `text` runs the same tokens without it. Reports ms, tokens/s, image
patches/s (real patches, not empty slots), TFLOPS by model/flops.py (the tower counted per
window of patch slots) and MFU against --peak-tflops. Prints a table and writes JSON (--out).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from report import write_json
from timing import timed

from titan_moe.data.multimodal import MultimodalPacker, batch_item, encode_document
from titan_moe.model.args import get_flavor
from titan_moe.model.flops import flops_per_token
from titan_moe.model.model import TitanMoE
from titan_moe.tokenizer import FLAVOR_VOCAB_SIZE, TitanTokenizer, asset_path

H200_BF16_DENSE_TFLOPS = 989.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="debug flavor and tower, 2 layers, seq 128, CPU, fp32")
    parser.add_argument("--flavor", default="proxy", choices=("debug", "proxy"))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--min-side", type=int, default=112)
    parser.add_argument("--max-side", type=int, default=896)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compile decoder layers and ViT "
                        "blocks (fullgraph), as parallelize.py does")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--out", type=Path, default=Path("vision_step.json"))
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.flavor, opts.seq_len, opts.batch = "debug", 128, 2
        opts.min_side, opts.max_side, opts.warmup, opts.iters = 28, 120, 1, 2
    if opts.seq_len % 64:
        parser.error(f"--seq-len must be a multiple of the KDA chunk 64, got {opts.seq_len}")
    return opts


def build_batch(opts, tokenizer, vision, device) -> dict[str, torch.Tensor]:
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


def bench(opts) -> list[dict]:
    device = "cpu" if opts.tiny or not torch.cuda.is_available() else "cuda"
    args = dataclasses.replace(get_flavor(opts.flavor), vision=opts.flavor,
                               max_seq_len=opts.seq_len)
    if opts.tiny:
        args = dataclasses.replace(args, n_layers=2, mla_layers=(2,))
    args.validate()
    vision = args.vision_config()
    tokenizer = TitanTokenizer(asset_path(FLAVOR_VOCAB_SIZE[opts.flavor]))
    batch = build_batch(opts, tokenizer, vision, device)
    labels = torch.roll(batch["input"], -1, dims=1)
    with torch.device(device):
        model = TitanMoE(args)
    model.init_weights()
    if opts.compile:
        for layers in (model.layers, model.vision.blocks):
            for name, layer in list(layers.named_children()):
                layers.register_module(name, torch.compile(layer, fullgraph=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    n_tokens = batch["input"].numel()
    n_patches = int((batch["patch_image"] >= 0).sum())
    rows = []
    for mode in ("multimodal", "text"):
        image_inputs = ([batch["patches"], batch["patch_pos"], batch["patch_image"]]
                        if mode == "multimodal" else [])

        def step(image_inputs=image_inputs):
            with amp:
                logits = model(batch["input"], batch["doc_ids"], *image_inputs)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         labels.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = timed(step, device, opts.warmup, opts.iters)
        step_args = args if mode == "multimodal" else dataclasses.replace(args, vision="none")
        tflops = flops_per_token(step_args, opts.seq_len) * n_tokens / (ms * 1e-3) / 1e12
        rows.append({
            "mode": mode, "flavor": opts.flavor, "device": device, "batch": opts.batch,
            "seq_len": opts.seq_len, "patch_slots": vision.window_patches * opts.batch,
            "image_patches": n_patches if mode == "multimodal" else 0,
            "ms": ms, "tokens_per_s": n_tokens / (ms * 1e-3),
            "patches_per_s": (n_patches if mode == "multimodal" else 0) / (ms * 1e-3),
            "tflops": tflops, "mfu_pct": 100 * tflops / opts.peak_tflops if device == "cuda"
            else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda"
            else None,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    rows = bench(opts)
    print(f"{'mode':<11} {'ms':>9} {'tok/s':>10} {'patch/s':>10} {'TFLOPS':>8} {'MFU%':>6}")
    for r in rows:
        mfu = f"{r['mfu_pct']:6.1f}" if r["mfu_pct"] is not None else "     -"
        print(f"{r['mode']:<11} {r['ms']:9.1f} {r['tokens_per_s']:10.0f} "
              f"{r['patches_per_s']:10.0f} {r['tflops']:8.3f} {mfu}")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
