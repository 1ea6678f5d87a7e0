"""Long-context training step: one forward+backward of a whole model at batch 1, per length.

    python bench/long_context.py --out lc.json                  # H200: proxy, 8K 64K 256K 1M
    python bench/long_context.py --tiny --out lc_cpu.json       # CPU smoke: debug, 2 layers

What makes 1M tokens fit: full activation checkpointing of every decoder layer (torchtitan's
apply_ac), KDA by chunks with a constant state (the Triton op), MLA through Flash Attention's
varlen kernel with document masking (no [T, T] mask), and the loss by chunks of positions
(`chunked_linear_cross_entropy`: the [T, vocab] logits never exist at once). Parameters are
bf16 (FSDP's param_dtype in training; no fp32 master copy or optimizer state is held here).
Documents of --doc-len tokens keep attention's cost T·doc_len rather than T².
Per length: time of the step (median of --iters after --warmup), time per token, and
torch.cuda.max_memory_allocated; an out-of-memory length is recorded as such, not raised.
"""

import argparse
import json
import time

import torch
import torch.nn as nn
from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac

from titan_moe.chunked_loss import chunked_linear_cross_entropy
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE

LENGTHS = "8192,65536,262144,1048576"


def build(flavor: str, n_layers: int | None, device: str, dtype: torch.dtype) -> TitanMoE:
    args = get_flavor(flavor)
    if n_layers is not None:
        args.n_layers, args.mla_layers = n_layers, (n_layers,)
    with torch.device("meta"):
        model = TitanMoE(args.validate())
    model.to_empty(device=device)
    model.init_weights()
    model.to(dtype)
    for module in model.modules():  # buffers (the QB biases) stay fp32, as under FSDP
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.float())
    apply_ac(model, ActivationCheckpoint(mode="full"))
    return model


def step(model: TitanMoE, head: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
         doc_ids: torch.Tensor) -> float:
    loss = chunked_linear_cross_entropy(model(tokens, doc_ids), head, labels)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    head.grad = None
    return loss.item() / tokens.numel()


def measure(model: TitanMoE, head: torch.Tensor, length: int, doc_len: int, device: str,
            warmup: int, iters: int) -> dict:
    vocab = head.shape[0]
    tokens = torch.randint(0, vocab, (1, length + 1), device=device)
    doc_ids = (torch.arange(length, device=device) // doc_len).to(torch.int32)[None]
    row = {"seq_len": length, "doc_len": min(doc_len, length)}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(warmup):
            step(model, head, tokens[:, :-1], tokens[:, 1:], doc_ids)
        times = []
        for _ in range(iters):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            row["loss_per_token"] = step(model, head, tokens[:, :-1], tokens[:, 1:], doc_ids)
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    else:
        seconds = sorted(times)[len(times) // 2]
        row.update(status="ok", step_s=seconds, us_per_token=1e6 * seconds / length)
    if device == "cuda":
        row["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: debug flavor, 2 layers, lengths 128,256")
    parser.add_argument("--flavor", default="proxy")
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--lengths", default=LENGTHS, help="comma-separated sequence lengths")
    parser.add_argument("--doc-len", type=int, default=65536, help="tokens per document")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.flavor, args.n_layers, args.lengths = "debug", 2, "128,256"
        args.warmup, args.doc_len = 0, 96
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(args.flavor, args.n_layers, device, dtype)
    head = model.output.weight
    model.output = nn.Identity()  # the head runs inside the chunked loss
    rows = [measure(model, head, int(n), args.doc_len, device, args.warmup, args.iters)
            for n in args.lengths.split(",")]
    print(f"{'seq_len':>9} {'status':>6} {'step s':>9} {'us/token':>9} {'max GiB':>8}")
    for r in rows:
        print(f"{r['seq_len']:>9} {r['status']:>6} {r.get('step_s', float('nan')):>9.3f} "
              f"{r.get('us_per_token', float('nan')):>9.2f} "
              f"{r.get('max_memory_allocated_gib', float('nan')):>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"flavor": args.flavor, "device": device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
