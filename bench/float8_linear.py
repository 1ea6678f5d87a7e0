"""float8 per linear: each nn.Linear shape that the `[float8]` size filter converts in a flavor,
forward+backward compiled in bf16 and as torchao's Float8Linear, side by side.

    python bench/float8_linear.py --out f8.json                 # GPU: the proxy's linears
    python bench/float8_linear.py --recipes rowwise,tensorwise --tokens 8192 --out f8.json
    python bench/float8_linear.py --tiny --out f8.json          # CPU smoke: emulated float8

Why: float8 training of the proxy ran at 0.85x bf16 (H200, 2026-12-06, rowwise, dense linears),
where the issue asks 1.15x. A linear gains where its three GEMMs' float8 savings exceed the
casts torchao adds (amax and scale, to float8, for the input, the weight and the output
gradient, each in the layouts its GEMMs take): this table says which shapes gain, by how much,
and what the converted linears add up to in one step of the flavor. Per shape (the flavor's
(in, out) pairs, each with how many modules have it, the LM head skipped as `[float8]` does):
bf16 and each recipe's f+b ms (median of --iters after --warmup, inputs of --tokens rows,
bf16 autocast over fp32 weights as the trainer runs them), the speed-up, and the bf16 GEMMs'
TFLOP/s (6 x tokens x in x out FLOPs a f+b). On CUDA the f+b is captured in a CUDA graph and
replayed, as the graphed training step runs it: timed between events instead, one linear's
f+b is host-bound (every shape about 1 ms, 100-200 TFLOP/s in bf16 at 2048 x 2048, H100,
2026-12-06), and the table compared launch costs, not GEMMs and casts; the events' time is
kept in the JSON (`*_event_ms`). The summary weights each shape by
its count: the converted linears' f+b time a step, bf16 against float8. Prints a table and
writes JSON (--out).
"""

import argparse
import collections
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
from report import write_json
from timing import event_timed, graphed_ms

from float8 import dense_linear_filter
from titan_moe.cli_args import non_negative, positive
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE

TINY = {"flavor": "debug", "tokens": 64, "filter_min_size": 256, "warmup": 1, "iters": 2}
RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")


def converted_shapes(flavor: str, filter_min_size: int, skip: list[str]
                     ) -> list[tuple[int, int, int, str]]:
    """(in, out, modules, an example name) of every Linear shape the float8 filter converts in
    the flavor, most modules first (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        model = TitanMoE(get_flavor(flavor))
    keep = dense_linear_filter(SimpleNamespace(filter_min_size=filter_min_size, skip=skip))
    shapes = collections.defaultdict(list)
    for name, module in model.named_modules():
        if keep(module, name):
            shapes[(module.in_features, module.out_features)].append(name)
    return [(i, o, len(names), names[0])
            for (i, o), names in sorted(shapes.items(), key=lambda kv: -len(kv[1]))]


def linear_step(in_features: int, out_features: int, tokens: int, recipe: str | None,
                device: str, emulate: bool):
    """A compiled f+b of one fp32 Linear under bf16 autocast (float8 when recipe is given),
    returning its input and weight gradients."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layer = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(device)
    if recipe is not None:
        config = Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            config = dataclasses.replace(config, emulate=True)
        convert_to_float8_training(layer, config=config)
    x = torch.randn(tokens, in_features, device=device, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)

    torch._dynamo.reset()  # every row compiles its own layer (Dynamo's recompile limit)
    forward = torch.compile(layer, fullgraph=True)  # its backward compiled with it

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            y = forward(x)
        return torch.autograd.grad(y, (x, layer[0].weight), grad)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="proxy")
    parser.add_argument("--tokens", type=positive, default=8192,
                        help="rows a step: batch x seq_len of bench/float8_training.py's run")
    parser.add_argument("--recipes", default="rowwise,tensorwise",
                        help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--filter-min-size", type=positive, default=1024)
    parser.add_argument("--warmup", type=non_negative, default=5)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, debug flavor, emulated float8: a check, not a figure")
    parser.add_argument("--out", type=Path, default=Path("float8_linear.json"))
    opts = parser.parse_args(argv)
    recipes = [r for r in opts.recipes.split(",") if r]
    if not recipes or any(r not in RECIPES for r in recipes):
        parser.error(f"--recipes: each of {', '.join(RECIPES)}, got {opts.recipes!r}")
    if opts.tiny:
        vars(opts).update(TINY)
    device = "cuda" if torch.cuda.is_available() and not opts.tiny else "cpu"
    if device == "cpu" and not opts.tiny:
        parser.error("timing float8 needs CUDA (capability >= 8.9); --tiny emulates it on CPU")
    rows = []
    print(f"{opts.flavor}: linears the float8 filter converts (>= {opts.filter_min_size}), "
          f"{opts.tokens} tokens, f+b ms" + (" (CUDA-graphed)" if device == "cuda" else ""))
    print(f"{'in':>6} {'out':>6} {'n':>3} {'bf16':>8} {'TFLOP/s':>8} "
          + " ".join(f"{r:>18}" for r in recipes))
    for in_features, out_features, count, example in converted_shapes(
            opts.flavor, opts.filter_min_size, ["output"]):
        row = {"in": in_features, "out": out_features, "modules": count, "example": example}
        for name, recipe in (("bf16", None), *((r, r) for r in recipes)):
            step = linear_step(in_features, out_features, opts.tokens, recipe, device, opts.tiny)
            row[f"{name}_event_ms"] = event_timed(step, device, opts.warmup, opts.iters)
            row[f"{name}_ms"] = (graphed_ms(step, opts.warmup, opts.iters) if device == "cuda"
                                 else row[f"{name}_event_ms"])
            if recipe is not None:
                row[f"{recipe}_speedup"] = row["bf16_ms"] / row[f"{recipe}_ms"]
        row["bf16_tflops"] = 6 * opts.tokens * in_features * out_features / row["bf16_ms"] / 1e9
        rows.append(row)
        print(f"{in_features:>6} {out_features:>6} {count:>3} {row['bf16_ms']:8.3f} "
              f"{row['bf16_tflops']:8.1f} " + " ".join(
                  f"{row[f'{r}_ms']:8.3f} ({row[f'{r}_speedup']:.2f}x)" for r in recipes),
              flush=True)
    total = {"bf16_ms": sum(r["bf16_ms"] * r["modules"] for r in rows)}
    for recipe in recipes:
        total[f"{recipe}_ms"] = sum(r[f"{recipe}_ms"] * r["modules"] for r in rows)
        total[f"{recipe}_speedup"] = total["bf16_ms"] / total[f"{recipe}_ms"]
    rows.append({"summary": "every converted linear of one step, weighted by its modules",
                 **total})
    print("a step's converted linears: bf16 {:.3f} ms; ".format(total["bf16_ms"]) + "; ".join(
        f"{r} {total[f'{r}_ms']:.3f} ms ({total[f'{r}_speedup']:.2f}x)" for r in recipes))
    write_json(opts.out, opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
