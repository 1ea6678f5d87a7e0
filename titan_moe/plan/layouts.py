"""The layouts a plan weighs and prints: every EP degree and every CP degree (CP runs without EP
or KDA segments, as the trainer requires) of a GPU count, each with its per-GPU memory
(memory.py), and the fewest GPUs with a layout that fits."""

from dataclasses import replace

from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE
from titan_moe.plan.config import PlanConfig
from titan_moe.plan.memory import (
    GB,
    HEADROOM,
    HOST_HEADROOM,
    HOST_MEM_GB,
    Activations,
    Estimate,
    ParamCounts,
    activation_bytes,
    estimate,
    largest_recompute,
    parameter_counts,
)


def ep_degrees(gpus: int, n_experts: int) -> list[int]:
    """EP degrees a layout can use: powers of two dividing both the GPU and the expert count."""
    return [d for d in (2**i for i in range(16)) if d <= gpus and not gpus % d
            and not n_experts % d]


def cp_degrees(gpus: int, seq_len: int) -> list[int]:
    """CP degrees above 1 a layout can use: powers of two dividing the GPUs, each rank holding
    whole KDA chunks (the trainer's rule)."""
    return [d for d in (2**i for i in range(1, 16)) if d <= gpus and not gpus % d
            and not seq_len % (d * KDA_CHUNK_SIZE)]


def layouts(cfg: PlanConfig, gpus: int, counts: ParamCounts,
            activations: dict[int, Activations]) -> list[Estimate]:
    """Every EP layout, and every CP layout (CP runs without EP or KDA segments, as the trainer
    requires), of `gpus` GPUs; `activations` caches them per CP degree."""
    degrees = [(ep, 1) for ep in ep_degrees(gpus, cfg.args.n_experts)]
    if not cfg.args.seq_segment:
        degrees += [(1, cp) for cp in cp_degrees(gpus, cfg.seq_len)]
    rows = []
    for ep, cp in degrees:
        at = replace(cfg, cp=cp)
        if cp not in activations:
            activations[cp] = activation_bytes(at)
        rows.append(estimate(at, gpus, ep, counts, activations[cp]))
    return rows


def fewest_gpus(cfg: PlanConfig, gpu_mem_gb: float, step: int = 8, limit: int = 1 << 16,
                host_mem_gb: float = HOST_MEM_GB) -> Estimate | None:
    """The smallest multiple of `step` GPUs (1 to `step` first) with a layout that fits."""
    counts, activations = parameter_counts(cfg.args), {}
    candidates = [n for n in (1, 2, 4) if n < step] + list(range(step, limit + 1, step))
    for gpus in candidates:
        best = min(layouts(cfg, gpus, counts, activations), key=lambda e: e.peak)
        if best.fits(gpu_mem_gb, host_mem_gb):
            return best
    return None


def _row(e: Estimate, gpu_mem_gb: float, host_mem_gb: float) -> str:
    cells = [e.parameters, e.gradients, e.optimizer, e.working, e.activations, e.peak, e.host]
    fit = "yes" if e.fits(gpu_mem_gb, host_mem_gb) else "no"
    return (f"| {e.gpus} | {e.ep} | {e.cp} | {e.gpus // (e.ep * e.cp)} | "
            + " | ".join(f"{c / GB:.1f}" for c in cells) + f" | {fit} |")


def print_plan(cfg: PlanConfig, gpus: int, gpu_mem_gb: float,
               host_mem_gb: float = HOST_MEM_GB) -> list[Estimate]:
    counts, activations = parameter_counts(cfg.args), {}
    rows = layouts(cfg, gpus, counts, activations)
    print(f"{counts.total / 1e9:.1f}B parameters ({counts.experts / 1e9:.1f}B routed experts); "
          f"{cfg.local_batch}×{cfg.seq_len} tokens a CP group; AC {cfg.ac_mode}; loss_chunk "
          f"{cfg.loss_chunk or 'none (full logits)'}; MoE token chunk "
          f"{cfg.args.moe_token_chunk or 'none'}; sequence segment "
          f"{cfg.args.seq_segment or 'none'}; activation offload "
          f"{'on' if cfg.offload else 'off'}; GB per GPU (fits: peak <= {HEADROOM:.0%} of "
          f"{gpu_mem_gb:g} GB and host <= {HOST_HEADROOM:.0%} of {host_mem_gb:.1f} GB)")
    print("| GPUs | EP | CP | dp | params | grads | optimizer | working | activations | peak "
          "| host | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in rows:
        print(_row(e, gpu_mem_gb, host_mem_gb))
    layer, held = largest_recompute(cfg)
    if layer >= 0:
        print(f"largest layer recompute in backward: layer {layer}, {held / GB:.1f} GB at "
              f"{cfg.seq_len // cfg.cp} positions a GPU (CP divides it)")
    best = fewest_gpus(cfg, gpu_mem_gb, host_mem_gb=host_mem_gb)
    if best is None:
        print("fits on no layout up to 65536 GPUs")
    else:
        print(f"fewest GPUs: {best.gpus} (EP {best.ep} × CP {best.cp} × dp "
              f"{best.gpus // (best.ep * best.cp)}), peak {best.peak / GB:.1f} GB, host "
              f"{best.host / GB:.1f} GB a GPU")
        if best.cp != cfg.cp:
            print(f"  set parallelism.context_parallel_degree = {best.cp} (the config has "
                  f"{cfg.cp}): one GPU's share of a sequence does not fit with {cfg.cp}")
    return rows + ([best] if best else [])
