"""Router GEMM precision: how many routes change with bf16 operands, and what it saves.

    python bench/router_precision.py            # H200: proxy flavor, seq 4096, real text
    python bench/router_precision.py --smoke    # CPU: tiny debug model, seq 256
    python bench/router_precision.py --device cpu --seq-len 1024   # CPU: the proxy

The router's logits are fp32 (model/router.py); its weight is fp32, its input bf16 under mixed
precision. Candidates against the fp32 GEMM: the router's default split_bf16 (two bf16 GEMMs
against the weight's high and low bf16 parts, fp32 output: ops/split_bf16_linear.py), one GEMM
of bf16 operands with fp32 accumulation and output (`mm_fp32`), and bf16 operands with a bf16
output (plain autocast). Routes: for every MoE layer of a seeded model the router's input is
captured on --seq-len tokens of Python source (this interpreter's standard library, tokenised by
the flavor's tokenizer) in one forward, bf16 autocast on CUDA (on the CPU the captured inputs
are rounded to bf16, as the GPU's would be); each candidate's top-k of σ(logits) (bias 0) is
compared with fp32's as expert sets per token: the share of tokens whose set changes, and of
(token, slot) pairs whose expert changes. Time: the router GEMM alone, bf16 activations, at
--gemm-shape (the routing issue's T 16384, d 7168, E 896), median of --iters. Prints a table,
writes JSON. An untrained model's activations are what is measured: say so when quoting it.
"""

import argparse
import dataclasses
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from report import write_json
from timing import timed

from titan_moe.cli_args import non_negative, positive
from titan_moe.data.tokenizer import FLAVOR_VOCAB_SIZE, TitanTokenizer, asset_path
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.model.router import Router
from titan_moe.ops.fp32_matmul import mm_fp32
from titan_moe.ops.split_bf16_linear import split_bf16_linear


def split_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return split_bf16_linear(x.bfloat16(), w.float())


def bf16_fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return mm_fp32(x.bfloat16(), w.bfloat16().t())


def bf16_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16(), w.bfloat16()).float()


def fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def source_tokens(tokenizer: TitanTokenizer, n: int) -> torch.Tensor:
    ids: list[int] = []
    for module in ("inspect", "argparse", "dataclasses", "json", "pathlib", "typing", "ast"):
        ids += tokenizer.encode(inspect.getsource(sys.modules.get(module) or __import__(module)))
        if len(ids) >= n:
            return torch.tensor(ids[:n])[None]
    raise ValueError(f"the sources give {len(ids)} tokens, fewer than --seq-len {n}")


def router_inputs(opts, device: str) -> list[tuple[torch.Tensor, Router]]:
    args = dataclasses.replace(get_flavor(opts.flavor), max_seq_len=opts.seq_len).validate()
    torch.manual_seed(0)
    with torch.device(device):
        model = TitanMoE(args)
    model.init_weights()
    captured = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp: captured.append((inp[0].detach(), mod)))
             for m in model.modules() if isinstance(m, Router)]
    tokens = source_tokens(TitanTokenizer(asset_path(FLAVOR_VOCAB_SIZE[opts.flavor])),
                           opts.seq_len).to(device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        model(tokens)
    for h in hooks:
        h.remove()
    return [(x.to(torch.bfloat16), router) for x, router in captured]


def changed_routes(x: torch.Tensor, router: Router, gemm) -> dict:
    want = fp32(x, router.weight).topk(router.top_k, dim=-1).indices.sort(-1).values
    got = gemm(x, router.weight).topk(router.top_k, dim=-1).indices.sort(-1).values
    slots = (got != want).float().mean().item()
    return {"tokens_changed": (got != want).any(-1).float().mean().item(),
            "slots_changed": slots}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: debug flavor, seq 256")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--flavor", default="proxy", choices=("debug", "proxy"))
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--gemm-shape", default="16384,7168,896", help="T,d,E")
    parser.add_argument("--warmup", type=non_negative, default=3)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--out", type=Path, default=Path("router_precision.json"))
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.flavor, opts.seq_len, opts.gemm_shape, opts.iters = "debug", 256, "256,256,16", 2
    if opts.seq_len < 1 or opts.iters < 1:
        parser.error("--seq-len and --iters must be >= 1")
    device = "cpu" if opts.smoke else opts.device
    gemms = {"fp32": fp32, "split_bf16": split_bf16, "bf16_fp32_out": bf16_fp32_out,
             "bf16_out": bf16_out}
    captured = router_inputs(opts, device)
    rows = []
    t, d, e = (int(v) for v in opts.gemm_shape.split(","))
    x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    w = 0.02 * torch.randn(e, d, device=device)
    for name, gemm in gemms.items():
        per_layer = [changed_routes(xi, r, gemm) for xi, r in captured]
        ms = timed(lambda gemm=gemm: gemm(x, w), device, opts.warmup, opts.iters)
        rows.append({
            "gemm": name, "gemm_ms": ms, "shape": [t, d, e],
            "tokens_changed": sum(r["tokens_changed"] for r in per_layer) / len(per_layer),
            "slots_changed": sum(r["slots_changed"] for r in per_layer) / len(per_layer),
            "max_layer_tokens_changed": max(r["tokens_changed"] for r in per_layer),
        })
    print(f"{len(captured)} MoE layers, {opts.seq_len} tokens, {opts.flavor} flavor (untrained)")
    print(f"{'gemm':<14} {'ms':>8} {'tokens changed':>15} {'slots changed':>14} "
          f"{'worst layer':>12}")
    for r in rows:
        print(f"{r['gemm']:<14} {r['gemm_ms']:8.3f} {100 * r['tokens_changed']:14.2f}% "
              f"{100 * r['slots_changed']:13.3f}% {100 * r['max_layer_tokens_changed']:11.2f}%")
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
