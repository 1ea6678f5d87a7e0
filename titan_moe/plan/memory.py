"""Per-GPU memory plan for FSDP2 × expert-parallel layouts, and the fewest GPUs a model fits on.

    python -m titan_moe.plan --config configs/full.toml --gpus 1024 --gpu-mem 141
    python -m titan_moe.plan --config configs/proxy.toml --validate      (one CUDA GPU)

The plan follows parallelize.py on N GPUs with EP degree ep (efsdp = N / ep), P parameters,
L the unsharded bytes of the largest layer (dense part + E/ep experts, bf16), b·T tokens a GPU:

    parameters   4 P / N            fp32 master weights, every parameter sharded over N ranks
    gradients    4 P / N            fp32 sharded gradients (present by the end of backward)
    optimizer    8 P / N            AdamW exp_avg and exp_avg_sq, fp32 (fused: no temporaries)
    working      10 L + 2 V d       backward of one layer: its bf16 params, the next layer's
                                    (prefetch), bf16 grads and their fp32 copy for the
                                    reduce-scatter; the LM head, kept unsharded fwd -> bwd
    activations  saved for backward at the start of backward, under the AC policy, plus the
                 loss (fp32 log-softmax, its gradient and the logits' gradient: 12 b T V) and,
                 with AC, one layer recomputed
    peak         parameters + optimizer + working + max(activations, gradients)

Gradients grow while the saved activations drain during backward, both about linearly, so the
larger of the two ends is the peak. Per-layer saved activations are counted by running the
layer on the meta device with saved-tensor hooks (each storage once, parameters excluded), with
stand-ins that save what the CUDA kernels save: flash attention (q, k, v, out, fp32 logsumexp),
the KDA Triton op (its inputs; it recomputes the rest), torch._grouped_mm (its operands).
"""

import contextlib
import math
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from titan_moe.model import kda as kda_module
from titan_moe.model import mla as mla_module
from titan_moe.model import moe as moe_module
from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args
from titan_moe.model.model import DecoderLayer, TitanMoE
from titan_moe.parallel.fp32_modules import FP32_MODULES
from titan_moe.parallel.parallelize import OP_SAC_SAVE_LIST, apply_fsdp
from titan_moe.parallel.pipeline import boundary_tensors

GB = 1e9
ACT_BYTES = 2  # bf16 activations under FSDP2's bf16 param policy
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
HEADROOM = 0.9  # of the GPU's memory: allocator fragmentation, NCCL buffers, CUDA context


@dataclass(frozen=True)
class PlanConfig:
    args: TitanMoEArgs
    seq_len: int
    local_batch: int
    ac_mode: str
    selective_ac_option: str


@dataclass(frozen=True)
class ParamCounts:
    total: int
    experts: int
    embedding: int
    output: int
    largest_layer_dense: int
    largest_layer_experts: int
    layer_dense: tuple[int, ...] = ()  # per decoder layer (pipeline stages are cut from these)
    layer_experts: tuple[int, ...] = ()

    @property
    def rest(self) -> int:
        """Parameters outside the layers, embedding and head: vision tower, final site, norm."""
        return (self.total - sum(self.layer_dense) - sum(self.layer_experts) - self.embedding
                - self.output)


@dataclass(frozen=True)
class Estimate:
    gpus: int
    ep: int
    parameters: float
    gradients: float
    optimizer: float
    working: float
    activations: float
    peak: float

    def fits(self, gpu_mem_gb: float, headroom: float = HEADROOM) -> bool:
        return self.peak <= headroom * gpu_mem_gb * GB


def load_plan_config(path: str) -> PlanConfig:
    """The model, sequence length, batch and AC policy of a TOML (nothing else is needed)."""
    with open(path, "rb") as f:
        toml = tomllib.load(f)
    model = toml.get("model", {})
    args = model_args(model.get("flavor", "debug"), **toml.get("titan_moe", {}))
    training = toml.get("training", {})
    ac = toml.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    if mode not in ("none", "full", "selective") or (mode == "selective" and not option.isdigit()):
        raise ConfigError(
            f"activation_checkpoint mode {mode!r} / selective_ac_option {option!r}: the plan "
            "models none, full and layer-selective (a digit) checkpointing"
        )
    return PlanConfig(args, training.get("seq_len", 2048), training.get("local_batch_size", 8),
                      mode, option)


def parameter_counts(args: TitanMoEArgs) -> ParamCounts:
    with torch.device("meta"):
        model = TitanMoE(args)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    dense_per_layer, experts_per_layer = [], []
    for layer in model.layers.values():
        e = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("ffn.experts."))
        experts_per_layer.append(e)
        dense_per_layer.append(sum(p.numel() for p in layer.parameters()) - e)
    return ParamCounts(
        total=sum(p.numel() for p in model.parameters()),
        experts=experts,
        embedding=model.tok_embeddings.weight.numel(),
        output=model.output.weight.numel(),
        largest_layer_dense=max(dense_per_layer),
        largest_layer_experts=max(experts_per_layer),
        layer_dense=tuple(dense_per_layer),
        layer_experts=tuple(experts_per_layer),
    )


def saved_bytes(run, exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `run()` executes, minus `exclude`'s."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    # Holding each storage keeps its address from being reused by a later one within the run
    # (a branch whose graph is dropped frees its saved tensors), which would count two as one.
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(s.nbytes() for s in seen.values())


class _SavesForBackward(torch.autograd.Function):
    """Output of a given shape; saves the given tensors (what a fused kernel keeps)."""

    @staticmethod
    def forward(ctx, out_like: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        return torch.empty_like(out_like)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a memory-plan stand-in; it never runs backward")


def _flash_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    b, h, t, _ = q.shape
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(b, h, t, dtype=torch.float32)
    return _SavesForBackward.apply(out, q, k, v, out, lse)


def _kda_triton_op(q, k, v, g_raw, A_log, dt_bias, beta, g_min=-5.0, **kwargs):
    return _SavesForBackward.apply(v, q, k, v, g_raw, beta, A_log, dt_bias), None


def _grouped_gemm(x, w, offs, zero_padding_rows=True):
    return torch._grouped_mm(x, w.to(x.dtype), offs=offs)


@contextlib.contextmanager
def _cuda_kernel_stand_ins() -> Iterator[None]:
    sdpa = mock.patch.object(mla_module.F, "scaled_dot_product_attention", _flash_attention)
    # The layer binds its recurrence at class level, so the stand-in replaces it there.
    kda = mock.patch.object(kda_module.KimiDeltaAttention, "sequence_recurrence",
                            staticmethod(_kda_triton_op))
    gmm = mock.patch.object(moe_module, "grouped_mm", _grouped_gemm)
    # torch.autocast has no meta device; the model only uses it to switch AMP off.
    amp = mock.patch.object(torch, "autocast", lambda *a, **k: contextlib.nullcontext())
    with sdpa, kda, gmm, amp:
        yield


def layer_activation_bytes(args: TitanMoEArgs, layer_id: int, batch: int, seq_len: int) -> int:
    """Bytes one decoder layer saves for backward (its inputs excluded), bf16 with fp32 islands."""
    with torch.device("meta"):
        layer = DecoderLayer(layer_id, args).to(torch.bfloat16)
        for module in layer.modules():
            if isinstance(module, FP32_MODULES):
                module.float()
        # Entering layer i: the embedding, every finished block and the partial sum.
        n_sources = boundary_tensors(args.attn_res_block_size, layer_id)
        sources = [torch.empty(batch, seq_len, args.dim, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(n_sources)]
    params = list(layer.parameters())
    with _cuda_kernel_stand_ins():
        return saved_bytes(lambda: layer(sources[:-1], sources[-1], None), params + sources)


def _checkpointed(cfg: PlanConfig, layer_id: int) -> bool:
    if cfg.ac_mode == "full":
        return True
    if cfg.ac_mode == "selective":
        return layer_id % int(cfg.selective_ac_option) == 0
    return False


def activation_bytes(cfg: PlanConfig, layers: range | None = None, batch: int | None = None,
                     loss: bool = True, held: float = 1) -> float:
    """Saved for backward at its start, the loss's buffers, and one layer's recompute: of the
    whole model at the local batch, or of `layers` (a pipeline stage, with the loss if it is
    the last) at `batch` rows (a micro-batch), the saved part for `held` micro-batches at once
    (the loss and the recompute are one micro-batch's at a time)."""
    args, t = cfg.args, cfg.seq_len
    b = cfg.local_batch if batch is None else batch
    layers = range(args.n_layers) if layers is None else layers
    stream = b * t * args.dim * ACT_BYTES
    # A layer's saved bytes depend on its kind and on how many AttnRes sources it reads.
    per_kind: dict[tuple[bool, bool, int], int] = {}
    saved, recompute = 0.0, 0
    for i in layers:
        kind = (args.is_mla(i), args.is_moe(i), boundary_tensors(args.attn_res_block_size, i))
        if kind not in per_kind:
            per_kind[kind] = layer_activation_bytes(args, i, b, t)
        if _checkpointed(cfg, i):
            recompute = max(recompute, per_kind[kind])
        else:
            saved += per_kind[kind]
    # Every layer's incoming partial sum stays alive (it is the checkpoint input, or a block).
    saved += len(layers) * stream
    loss_bytes = 12 * b * t * args.vocab_size if loss else 0
    # With AC, backward holds one layer's recomputed activations plus the gradients of the
    # residual sources it feeds (one per block, and the partial sum).
    n_blocks = math.ceil(layers.stop / args.attn_res_block_size)
    backward = recompute + (n_blocks + 1) * stream if recompute else 0
    return held * saved + loss_bytes + backward


def estimate(cfg: PlanConfig, gpus: int, ep: int, counts: ParamCounts | None = None,
             activations: float | None = None) -> Estimate:
    counts = counts or parameter_counts(cfg.args)
    activations = activation_bytes(cfg) if activations is None else activations
    per_rank = counts.total / gpus
    layer = counts.largest_layer_dense + counts.largest_layer_experts / ep
    working = 10 * layer + 2 * counts.output
    parameters, gradients = PARAM_BYTES * per_rank, GRAD_BYTES * per_rank
    optimizer = ADAM_BYTES * per_rank
    peak = parameters + optimizer + working + max(activations, gradients)
    return Estimate(gpus, ep, parameters, gradients, optimizer, working, activations, peak)


def ep_degrees(gpus: int, n_experts: int) -> list[int]:
    """EP degrees a layout can use: powers of two dividing both the GPU and the expert count."""
    return [d for d in (2**i for i in range(16)) if d <= gpus and not gpus % d
            and not n_experts % d]


def fewest_gpus(cfg: PlanConfig, gpu_mem_gb: float, step: int = 8,
                limit: int = 1 << 16) -> Estimate | None:
    """The smallest multiple of `step` GPUs (1 to `step` first) with a layout that fits."""
    counts, activations = parameter_counts(cfg.args), activation_bytes(cfg)
    candidates = [n for n in (1, 2, 4) if n < step] + list(range(step, limit + 1, step))
    for gpus in candidates:
        best = min((estimate(cfg, gpus, ep, counts, activations)
                    for ep in ep_degrees(gpus, cfg.args.n_experts)), key=lambda e: e.peak)
        if best.fits(gpu_mem_gb):
            return best
    return None


def _row(e: Estimate, gpu_mem_gb: float) -> str:
    cells = [e.parameters, e.gradients, e.optimizer, e.working, e.activations, e.peak]
    fit = "yes" if e.fits(gpu_mem_gb) else "no"
    return (f"| {e.gpus} | {e.ep} | {e.gpus // e.ep} | "
            + " | ".join(f"{c / GB:.1f}" for c in cells) + f" | {fit} |")


def print_plan(cfg: PlanConfig, gpus: int, gpu_mem_gb: float) -> list[Estimate]:
    counts, activations = parameter_counts(cfg.args), activation_bytes(cfg)
    rows = [estimate(cfg, gpus, ep, counts, activations)
            for ep in ep_degrees(gpus, cfg.args.n_experts)]
    print(f"{counts.total / 1e9:.1f}B parameters ({counts.experts / 1e9:.1f}B routed experts); "
          f"{cfg.local_batch}×{cfg.seq_len} tokens a GPU; AC {cfg.ac_mode}; GB per GPU "
          f"(fits: peak <= {HEADROOM:.0%} of {gpu_mem_gb:g} GB)")
    print("| GPUs | EP | efsdp | params | grads | optimizer | working | activations | peak "
          "| fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in rows:
        print(_row(e, gpu_mem_gb))
    best = fewest_gpus(cfg, gpu_mem_gb)
    if best is None:
        print("fits on no layout up to 65536 GPUs")
    else:
        print(f"fewest GPUs: {best.gpus} (EP {best.ep} × efsdp {best.gpus // best.ep}), "
              f"peak {best.peak / GB:.1f} GB")
    return rows + ([best] if best else [])


def validate(cfg: PlanConfig, steps: int) -> dict:
    """Train `steps` steps of the config on one CUDA GPU under FSDP2 (a one-rank mesh, so the
    memory follows the cluster's plan) and compare the measured peak with estimate(gpus=1)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    if not torch.cuda.is_available():
        raise SystemExit("error: --validate needs a CUDA GPU")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = TitanMoE(cfg.args)
    if cfg.ac_mode != "none":
        ac = ActivationCheckpoint(mode=cfg.ac_mode, selective_ac_option=cfg.selective_ac_option)
        apply_ac(model, ac, op_sac_save_list=OP_SAC_SAVE_LIST)
    apply_fsdp(model, mesh, torch.bfloat16, torch.float32)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(cfg.args.vocab_size, (cfg.local_batch, cfg.seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    planned = estimate(cfg, 1, 1)
    result = {"measured_gb": measured / GB, "planned_gb": planned.peak / GB,
              "ratio": planned.peak / measured, "plan": asdict(planned), "steps": steps}
    print(f"measured peak {measured / GB:.2f} GB, planned {planned.peak / GB:.2f} GB, "
          f"planned / measured = {result['ratio']:.3f} (target within 0.85 .. 1.15)")
    return result
