"""bf16 vs float8 training of the proxy flavor on one GPU: tokens/s, MFU and the loss curve.

    python bench/float8_training.py --steps 300 --compile --out outputs/bench/float8.json
    python bench/float8_training.py --plot outputs/bench/float8.json  (the loss curves, a PNG)
    python bench/float8_training.py --tiny                      (CPU: emulated float8, 3 steps)

Both variants start from the same weights and see the same batches: arithmetic sequences mod
the vocabulary (row i of step s starts at a and strides by d, both drawn from seed (s, i)), a
stream a model learns, so the loss curves say something. Training runs as the trainer does on
one GPU: fp32 parameters under bf16 autocast, fused AdamW, the configured AC policy.
Variants: bf16; float8 (dense linears, `[float8]` recipe and size filter); float8+moe (also the
routed experts' grouped GEMMs). Throughput and MFU exclude the first `--warmup` steps; the final
loss is the mean of the last 20 steps. Against bf16 each float8 variant reports its tokens/s
ratio and final-loss gap beside the float8 issue's targets (>= 1.15x, < 1% relative). The
float8 grouped GEMM's accuracy is a GPU test (tests/gpu/test_float8_cuda.py). --plot draws the
curves of a result JSON into a PNG beside it (needs matplotlib, the `plot` extra).
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from report import environment
from timing import device_profile

from float8 import convert_dense_linears, convert_routed_experts
from titan_moe.cli_args import non_negative, positive, positive_float
from titan_moe.model.args import TitanMoEArgs, get_flavor
from titan_moe.model.flops import flops_per_token
from titan_moe.model.model import TitanMoE
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.parallel.parallelize import apply_compile
from titan_moe.train.config import Float8

VARIANTS = ("bf16", "float8", "float8+moe")
FINAL_STEPS = 20  # the final loss: the mean of this many last steps
SPEEDUP_TARGET, LOSS_GAP_TARGET = 1.15, 0.01
TARGETS = {None: "baseline", True: "met", False: "not met"}


def arithmetic_batch(step: int, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
    out = torch.empty(rows, seq_len + 1, dtype=torch.long)
    for i in range(rows):
        g = torch.Generator().manual_seed(step * 100_003 + i)
        start, stride = torch.randint(vocab, (2,), generator=g).tolist()
        out[i] = (start + stride * torch.arange(seq_len + 1)) % vocab
    return out


def tiny_args() -> TitanMoEArgs:
    return TitanMoEArgs(vocab_size=128, dim=64, n_layers=2, mla_layers=(2,), dense_hidden=128,
                        n_heads=2, head_dim=32, kda_gate_rank=16, mla_n_heads=2, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        n_experts=8, top_k=2, latent_dim=32, expert_hidden=32,
                        shared_hidden=32).validate()


def build(args: TitanMoEArgs, variant: str, cfg: Float8, device: str, compile_model: bool,
          ac: bool) -> TitanMoE:
    torch.manual_seed(0)
    with torch.device(device):
        model = TitanMoE(args)
    model.init_weights()
    if variant != "bf16":
        convert_dense_linears(model, cfg)
    if variant == "float8+moe":
        convert_routed_experts(model, cfg)
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for layer_id, layer in model.layers.named_children():
            model.layers.register_module(layer_id, checkpoint_wrapper(layer))
    if compile_model:
        apply_compile(model, "inductor", set())
    return model


def run_variant(args, variant, cfg, ns, device) -> dict:
    # Each variant's modules share their classes' code objects with the last variant's, so
    # without a reset their compiles add up against the recompile limit (the third variant hit
    # it at AttnResSite.forward, one compile per source count, on 2026-12-05).
    torch.compiler.reset()
    model = build(args, variant, cfg, device, ns.compile, ns.ac)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr, weight_decay=0.1,
                                  fused=device == "cuda")
    balancer = QuantileBalancer(model)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    losses, times = [], []

    def train_step(step: int) -> torch.Tensor:
        batch = arithmetic_batch(step, ns.batch, ns.seq_len, args.vocab_size).to(device)
        with amp:
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
        return loss

    for step in range(ns.steps):
        start = time.perf_counter()
        loss = train_step(step)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % ns.log_every == 0:
            print(f"{variant:>10} step {step:4d} loss {losses[-1]:.4f} {times[-1] * 1e3:.0f} ms",
                  flush=True)
    timed = times[ns.warmup:] or times
    tokens_per_s = ns.batch * ns.seq_len * len(timed) / sum(timed)
    tail = losses[-FINAL_STEPS:]
    result = {"variant": variant, "tokens_per_s": tokens_per_s,
              "step_ms": 1e3 * sum(timed) / len(timed), "final_loss": sum(tail) / len(tail),
              "losses": losses}
    if device == "cuda":
        from torchtitan.tools.utils import get_peak_flops

        peak = get_peak_flops(torch.cuda.get_device_name())
        result["mfu"] = flops_per_token(args, ns.seq_len) * tokens_per_s / peak
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
        if ns.profile:  # one more step, after the measured ones
            profile = device_profile(lambda: train_step(ns.steps), result["step_ms"],
                                     top=ns.profile)
            result["classes"] = [{k: c[k] for k in ("class", "ms", "share", "top")}
                                 for c in profile["by_class"]]
            print(f"{variant}: " + ", ".join(f"{c['class']} {c['ms']:.1f} ms"
                                             for c in profile["by_class"]))
            for c in profile["by_class"]:
                for k in c["top"][:ns.profile]:
                    print(f"    {c['class'][:12]:<12} {k['ms']:7.2f} ms x{k['calls']:<4} "
                          f"{k['kernel'][:90]}")
    return result  # the model and its optimizer go with this frame


def compare(runs: list[dict]) -> list[dict]:
    """Each run against the first (bf16): tokens/s ratio and final-loss gap, and whether both
    meet the targets (None for the baseline itself)."""
    base = runs[0]
    for r in runs:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["final_loss_gap"] = (r["final_loss"] - base["final_loss"]) / base["final_loss"]
        r["meets_targets"] = None if r is base else (
            r["speedup"] >= SPEEDUP_TARGET and abs(r["final_loss_gap"]) < LOSS_GAP_TARGET)
    return runs


def plot(result_json: Path) -> Path:
    """The loss curves of a result JSON, each variant raw and as a 20-step mean, into a PNG."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(result_json.read_text())
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in result["runs"]:
        losses = torch.tensor(run["losses"])
        window = min(FINAL_STEPS, len(losses))
        mean = losses.unfold(0, window, 1).mean(1)
        line, = ax.plot(losses, alpha=0.3, linewidth=0.8)
        ax.plot(range(window - 1, len(losses)), mean, color=line.get_color(),
                label=f"{run['variant']}: {run['tokens_per_s']:,.0f} tok/s, "
                      f"final {run['final_loss']:.4f}")
    ax.set(xlabel="step", ylabel="loss",
           title=f"{result['flavor']}, batch {result['batch']} x {result['seq_len']}, "
                 f"{'compiled' if result['compile'] else 'eager'}, {result['recipe']}")
    ax.legend()
    out = result_json.with_suffix(".png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive, default=300)
    parser.add_argument("--warmup", type=non_negative, default=20,
                        help="steps left out of the timing")
    parser.add_argument("--batch", type=positive, default=2)
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--lr", type=positive_float, default=6e-4)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--recipe", default="rowwise",
                        choices=["rowwise", "tensorwise", "rowwise_with_gw_hp"])
    parser.add_argument("--filter-min-size", type=non_negative, default=1024)
    parser.add_argument("--compile", action="store_true", help="compile as training does")
    parser.add_argument("--ac", action="store_true", help="full activation checkpointing")
    parser.add_argument("--log-every", type=positive, default=25)
    parser.add_argument("--profile", type=non_negative, default=0, metavar="N",
                        help="CUDA: one more step profiled, device time by kernel class and "
                             "each class's N largest kernels (in the JSON too)")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny model, emulated float8")
    parser.add_argument("--plot", type=Path, help="a result JSON: draw its loss curves and stop")
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args(argv)
    if ns.plot:
        plot(ns.plot)
        return
    device = "cpu" if ns.tiny else "cuda"
    if ns.tiny:
        args = tiny_args()
        ns.seq_len, ns.steps, ns.warmup, ns.filter_min_size = 64, min(ns.steps, 3), 0, 32
        ns.variants = [v for v in ns.variants if v != "float8+moe"]
    else:
        args = get_flavor("proxy")
    cfg = Float8(enable=True, moe=True, recipe=ns.recipe, filter_min_size=ns.filter_min_size,
                 emulate=ns.tiny)
    runs = []
    for variant in ns.variants:
        runs = compare([*runs, run_variant(args, variant, cfg, ns, device)])
        # After every variant, so a run stopped by a time limit keeps the variants it finished.
        if ns.out:
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            ns.out.write_text(json.dumps({
                "environment": environment(), "flavor": "tiny" if ns.tiny else "proxy",
                "steps": ns.steps, "batch": ns.batch, "seq_len": ns.seq_len,
                "compile": ns.compile, "ac": ns.ac, "recipe": ns.recipe,
                "filter_min_size": ns.filter_min_size, "runs": runs}, indent=2))
    print(f"| variant | tokens/s | step ms | MFU | final loss (last {FINAL_STEPS}) | vs bf16 "
          f"tokens/s | loss gap | targets (>= {SPEEDUP_TARGET}x, < {100 * LOSS_GAP_TARGET:g}%) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu} | "
              f"{r['final_loss']:.4f} | {r['speedup']:.3f}x | {100 * r['final_loss_gap']:+.2f}% "
              f"| {TARGETS[r['meets_targets']]} |")

if __name__ == "__main__":
    main()
