"""The anchor row of bench/step.py: torchtitan 0.2.2's own deepseek_v3 model at the proxy's widths,
built, counted, compiled and initialised the way torchtitan's trainer does it on one device.

Proxy widths: MLA in every layer (16 heads, q/kv LoRA 512/256, qk 128+64, v 128), 64 routed
experts top-8 of hidden 768 plus 2 shared, one dense layer of hidden 8192. Routing keeps
torchtitan's MoEArgs defaults (sigmoid scores, aux-loss-free expert bias with coefficient 1e-3,
scores applied before the experts) with route_norm on. Attention is SDPA, causal over the whole
window (torchtitan's sdpa path has no document mask). The timed step leaves out torchtitan's
optimizer pre-hook that moves the expert bias, as the other rows leave out Quantile Balancing's.
FLOPs per token are torchtitan's (get_moe_model_nparams_and_flops): 6 x active parameters less
the embedding table (output head counted, routed experts at top_k / num_experts) + 6 x n_layers x
n_heads x (qk + v head dims) x seq_len: attention over the full square, where model/flops.py
counts the causal half.
"""

import contextlib
from collections.abc import Iterator

import torch
from torchtitan.config import JobConfig
from torchtitan.config.job_config import Compile
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.llama4.infra.parallelize import apply_compile
from torchtitan.models.moe import MoEArgs

PROXY = {"dim": 2048, "n_layers": 16, "n_dense_layers": 1, "inter_dim": 8192,
         "moe_inter_dim": 768, "n_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "num_experts": 64, "top_k": 8, "num_shared_experts": 2}
# Toy widths for --smoke: the cold CPU compile of each block stays in seconds.
SMOKE = {"dim": 64, "n_layers": 2, "n_dense_layers": 1, "inter_dim": 128, "moe_inter_dim": 32,
         "n_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 8, "top_k": 2,
         "num_shared_experts": 2}
_MOE_FIELDS = ("num_experts", "top_k", "num_shared_experts")


def model_args(seq_len: int, vocab_size: int, smoke: bool = False) -> DeepSeekV3ModelArgs:
    widths = dict(SMOKE if smoke else PROXY)
    moe = MoEArgs(route_norm=True, use_grouped_mm=True,
                  **{k: widths.pop(k) for k in _MOE_FIELDS})
    args = DeepSeekV3ModelArgs(vocab_size=vocab_size, attn_type="sdpa", attn_mask_type="causal",
                               moe_args=moe, **widths)
    # torchtitan's own finishing step: sets max_seq_len and moe_impl, and turns grouped mm off
    # below SM90 (so the CPU smoke runs its for-loop experts).
    job = JobConfig()
    job.training.seq_len = seq_len
    args.update_from_config(job)
    return args


def build(seq_len: int, vocab_size: int, device: str,
          smoke: bool = False) -> tuple[DeepSeekV3Model, int]:
    """The compiled, initialised model on device and torchtitan's training FLOPs per token.

    Seed before calling: the meta build draws nothing, so init_weights draws from the caller's seed.
    """
    args = model_args(seq_len, vocab_size, smoke)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    _, flops = args.get_nparams_and_flops(model, seq_len)
    # deepseek_v3's parallelize compiles with llama4's apply_compile: dense blocks whole, MoE
    # blocks per child (router, reorderer and shared experts, the experts' grouped mm apart),
    # each fullgraph. It needs no mesh with expert parallelism off.
    apply_compile(model, Compile(enable=True, components=["model"]), ep_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model.train(), flops


@contextlib.contextmanager
def row_scope(device: str) -> Iterator[None]:
    """Enter around building and timing the row: it keeps apply_compile's process-wide
    capture_scalar_outputs = True to this row, and on CPU lets torchtitan's router count its int64
    expert ids with torch.histc, which has no CPU kernel for integers (counted as floats, exact
    for ids below 2**24)."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        if device != "cpu":
            yield
            return
        histc = torch.histc

        def histc_cpu(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if input.is_floating_point():
                return histc(input, *args, **kwargs)
            return histc(input.float(), *args, **kwargs).to(input.dtype)

        torch.histc = histc_cpu
        try:
            yield
        finally:
            torch.histc = histc
