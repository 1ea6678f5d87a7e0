"""Model arguments and the three flavors of spec §9 (debug, proxy, full).

Every field can be overridden from the TOML `[titan_moe]` section; `validate()` runs at the
boundary and raises one `ConfigError` naming the field and what is allowed. torchtitan's
parameter and FLOP count (`get_nparams_and_flops`) needs the model, so it is added in
`flops.CountedTitanMoEArgs`, the class the TrainSpec's flavors have.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from torchtitan.protocols.model import BaseModelArgs

from titan_moe.config_types import type_name, value_matches
from titan_moe.model.router import ROUTER_GEMMS
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE
from titan_moe.ops.kda import KDA_BACKENDS
from titan_moe.ops.kda.fla_backend import FLA_INSTALL_HINT, FLA_INSTALLED


class ConfigError(ValueError):
    """An inconsistent or unsupported configuration; the message names the field."""


_VISION_OVERRIDES = ("max_patches", "window_patches")


@dataclass
class VisionArgs:
    """The vision tower of spec §7: a ViT over 14×14 patches with 2-D RoPE, a 2×2 patch merge
    and a projector into the decoder width. Chosen by `titan_moe.vision` (a VISION_FLAVORS name).
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    mlp_hidden: int = 256
    patch_size: int = 14
    merge: int = 2
    # Dynamic resolution: an image is resized so that its patch grid holds at most this many.
    max_patches: int = 64
    # Patch slots per packed window (the tower's fixed input length); images fill them in order.
    window_patches: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def validate(self, seq_len: int | None = None) -> VisionArgs:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                key = f"titan_moe.vision_{name}" if name in _VISION_OVERRIDES else (
                    f"VisionArgs.{name}")
                raise ConfigError(f"{key} = {getattr(self, name)!r}: {allowed}")

        for name in ("dim", "n_layers", "n_heads", "mlp_hidden", "max_patches",
                     "window_patches"):
            need(getattr(self, name) > 0, name, "must be a positive integer")
        need(self.patch_size == 14, "patch_size", "must be 14 (spec §7)")
        need(self.merge == 2, "merge", "must be 2 (spec §7: a 2×2 patch merge)")
        head_dim, rem = divmod(self.dim, self.n_heads)
        need(rem == 0 and head_dim % 4 == 0, "dim",
             f"must be n_heads ({self.n_heads}) × a head width divisible by 4 (2-D RoPE rotates "
             "pairs along rows and along columns)")
        group = self.merge * self.merge
        need(self.max_patches >= group and self.max_patches % group == 0, "max_patches",
             f"must be a positive multiple of {group} (one merged token per 2×2 patches)")
        need(self.window_patches % group == 0 and self.window_patches >= self.max_patches,
             "window_patches", f"must be a multiple of {group} and >= vision_max_patches = "
             f"{self.max_patches} (a window must hold the largest image)")
        tokens = self.max_patches // group + 2  # image_start + placeholders + image_end
        if seq_len is not None:
            need(tokens <= seq_len, "max_patches",
                 f"gives images of up to {tokens} tokens, more than training.seq_len = {seq_len}")
        return self


@dataclass
class TitanMoEArgs(BaseModelArgs):
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 8
    # 1-based indices of the Gated-MLA layers; every other layer is KDA.
    mla_layers: tuple[int, ...] = (4, 8)
    n_dense_layers: int = 1
    dense_hidden: int = 1024
    norm_eps: float = 1e-5

    # Block AttnRes (spec §2).
    attn_res_block_size: int = 2
    attn_res_eps: float = 1e-6
    # Long context: each finished block's gradient summed in place, in a buffer its sites' eager
    # backward adds into (model/attn_res_sink.py), so a site's backward returns one source
    # gradient instead of one for each of its sources; the sites then stay out of compile.
    attn_res_grad_sink: bool = False
    # Long context: the decoder layers' input norms save their output for backward instead of
    # their input (model/norm.py), so a layer's recompute saves two [T, dim] tensors fewer.
    norm_saves_output: bool = False

    # KDA (spec §3): d_k = d_v = head_dim.
    n_heads: int = 2
    head_dim: int = 128
    kda_dim: int | None = None  # optional cross-check: must equal n_heads * head_dim
    kda_gate_rank: int = 128
    kda_conv_size: int = 4
    kda_g_min: float = -5.0
    # CUDA kernels of the KDA recurrence (titan_moe.ops.kda.KDA_BACKENDS); CPU runs PyTorch.
    kda_backend: str = "auto"

    # Gated MLA with NoPE (spec §4).
    mla_n_heads: int = 2
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    qk_head_dim: int | None = None  # optional cross-check: nope + rope
    v_head_dim: int = 128

    # Stable LatentMoE (spec §5) and Quantile Balancing (spec §6).
    n_experts: int = 16
    top_k: int = 2
    n_shared_experts: int = 1
    shared_hidden: int = 256
    latent_dim: int = 128
    expert_hidden: int = 256
    route_scale: float = 1.0
    qb_bins: int = 1000
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0
    # The router GEMM (model/router.py ROUTER_GEMMS): "split_bf16" runs bf16 activations as two
    # bf16 GEMMs against the fp32 weight's high and low parts (fp32-accurate, tensor cores);
    # "fp32" widens them for one fp32 GEMM. Either way the logits are fp32.
    router_gemm: str = "split_bf16"
    # Long context: run each MoE layer over chunks of this many (flattened) tokens, each under
    # its own activation checkpoint, so backward holds one chunk's expert buffers; 0: no chunks.
    moe_token_chunk: int = 0
    # Long context: run each KDA mixer by segments of this many positions of each row (the
    # recurrent state and the conv taps carried from one to the next), each MLA mixer by query
    # segments of this many positions (each against its causal prefix by key segments of as
    # many, up-projected per key segment from the latents computed once) and each dense FFN by
    # chunks of this many flattened tokens, every segment under its own activation checkpoint,
    # so backward holds one segment's intermediates; 0: whole sequences. A multiple of the KDA
    # chunk (64); no context parallelism (it replaces the mixers' sequence steps).
    seq_segment: int = 0

    # Vision tower (spec §7): "none" (text only) or a VISION_FLAVORS name; the two patch
    # budgets override the vision flavor's when > 0. `<|image|>` placeholders carry its output.
    vision: str = "none"
    vision_max_patches: int = 0
    vision_window_patches: int = 0
    image_token_id: int = 3

    init_std: float = 0.02
    max_seq_len: int = 8192

    def validate(self) -> TitanMoEArgs:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"titan_moe.{name} = {getattr(self, name)!r}: {allowed}")

        for name in (
            "vocab_size", "dim", "n_layers", "dense_hidden", "attn_res_block_size",
            "n_heads", "head_dim", "kda_gate_rank", "kda_conv_size",
            "mla_n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "n_experts", "top_k", "latent_dim", "expert_hidden", "qb_bins",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, name, "must be a positive integer")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        need(0 <= self.n_dense_layers <= self.n_layers, "n_dense_layers",
             f"must be in [0, n_layers={self.n_layers}]")
        need(self.kda_dim is None or self.kda_dim == self.n_heads * self.head_dim, "kda_dim",
             f"must equal n_heads·head_dim = {self.n_heads}·{self.head_dim} = "
             f"{self.n_heads * self.head_dim} (or be left unset)")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        need(self.qk_head_dim is None or self.qk_head_dim == qk, "qk_head_dim",
             f"must equal qk_nope_head_dim + qk_rope_head_dim = {qk} (or be left unset)")
        need(self.head_dim % 16 == 0, "head_dim",
             "must be a multiple of 16 (the KDA kernels' 16-token tiles)")
        need(self.kda_g_min < 0, "kda_g_min", "must be < 0 (the decay's lower bound, spec: -5)")
        need(self.kda_g_min >= -5.0, "kda_g_min",
             "must be >= -5: the 16-token diagonal tiles are only safe for g >= -5 (spec §3)")
        need(self.kda_backend in KDA_BACKENDS, "kda_backend",
             f"must be one of {', '.join(KDA_BACKENDS)}")
        need(self.kda_backend != "fla" or FLA_INSTALLED, "kda_backend",
             f"'fla' needs fla-core, which is not installed: {FLA_INSTALL_HINT}")
        need(self.top_k <= self.n_experts, "top_k",
             f"must be <= n_experts = {self.n_experts}")
        need(self.top_k < self.n_experts, "top_k",
             f"must be < n_experts = {self.n_experts}: Quantile Balancing needs the (k+1)-th score")
        need(self.n_shared_experts == 0 or self.shared_hidden > 0, "shared_hidden",
             "must be positive when n_shared_experts > 0")
        need(isinstance(self.attn_res_grad_sink, bool), "attn_res_grad_sink",
             "must be true or false")
        need(isinstance(self.norm_saves_output, bool), "norm_saves_output",
             "must be true or false")
        need(isinstance(self.moe_token_chunk, int) and self.moe_token_chunk >= 0,
             "moe_token_chunk", "must be an integer >= 0 (tokens a MoE chunk; 0: no chunks)")
        need(isinstance(self.seq_segment, int) and self.seq_segment >= 0
             and self.seq_segment % KDA_CHUNK_SIZE == 0, "seq_segment",
             f"must be 0 (whole sequences) or a positive multiple of the KDA chunk "
             f"({KDA_CHUNK_SIZE}): positions a segment")
        need(self.seq_segment == 0 or self.seq_segment >= self.kda_conv_size - 1, "seq_segment",
             f"must hold the KDA conv's {self.kda_conv_size - 1} taps carried to the next "
             f"segment (kda_conv_size - 1), or be 0")
        need(self.route_scale > 0, "route_scale", "must be > 0")
        need(self.router_gemm in ROUTER_GEMMS, "router_gemm",
             f"must be one of {', '.join(ROUTER_GEMMS)}")
        need(self.situ_beta1 > 0 and self.situ_beta2 > 0, "situ_beta1",
             "situ_beta1 and situ_beta2 must be > 0")
        mla = tuple(self.mla_layers)
        need(all(isinstance(i, int) and 1 <= i <= self.n_layers for i in mla), "mla_layers",
             f"must be 1-based layer indices in [1, n_layers={self.n_layers}]")
        need(len(set(mla)) == len(mla), "mla_layers", "must not repeat a layer")
        self.mla_layers = mla
        need(self.vision == "none" or self.vision in VISION_FLAVORS, "vision",
             f"allowed: none, {', '.join(VISION_FLAVORS)}")
        need(0 <= self.image_token_id < self.vocab_size, "image_token_id",
             f"must be a token id in [0, vocab_size={self.vocab_size})")
        self.vision_config()
        return self

    def vision_config(self) -> VisionArgs | None:
        """The validated vision tower config, or None for a text-only model."""
        if self.vision == "none":
            return None
        vision = dataclasses.replace(VISION_FLAVORS[self.vision])
        if self.vision_max_patches > 0:
            vision.max_patches = self.vision_max_patches
            vision.window_patches = max(vision.window_patches, vision.max_patches)
        if self.vision_window_patches > 0:
            vision.window_patches = self.vision_window_patches
        return vision.validate(self.max_seq_len)

    # The schedule, 0-based.
    def is_mla(self, layer_id: int) -> bool:
        return (layer_id + 1) in self.mla_layers

    def is_moe(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    def update_from_config(self, job_config, **kwargs) -> None:
        overrides = getattr(job_config, "titan_moe", None)
        if overrides is not None:
            apply_overrides(self, dataclasses.asdict(overrides) if dataclasses.is_dataclass(
                overrides) else dict(overrides))
        self.max_seq_len = job_config.training.seq_len
        self.vocab_size = kwargs.get("vocab_size", self.vocab_size)
        self.validate()


def apply_overrides(args: TitanMoEArgs, overrides: dict) -> TitanMoEArgs:
    """Set fields from a mapping, rejecting unknown names and wrong types with one clear error
    (the type check of TOML and CLI values, config_types.value_matches)."""
    fields = {f.name for f in dataclasses.fields(args) if not f.name.startswith("_")}
    hints = typing.get_type_hints(type(args))
    for name, value in overrides.items():
        if value is None:
            continue
        if name not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"titan_moe.{name}: unknown field; allowed: {allowed}")
        if not value_matches(hints[name], value):
            raise ConfigError(
                f"titan_moe.{name} = {value!r}: expected {type_name(hints[name])}, "
                f"got {type(value).__name__}"
            )
        if typing.get_origin(hints[name]) is tuple:
            value = tuple(value)  # TOML and the CLI give lists
        setattr(args, name, value)
    return args.validate()


def _every_fourth_and_last(n_layers: int) -> tuple[int, ...]:
    return tuple(sorted(set(range(4, n_layers + 1, 4)) | {n_layers}))


FLAVORS: dict[str, TitanMoEArgs] = {
    "debug": TitanMoEArgs(),
    "proxy": TitanMoEArgs(
        vocab_size=32768, dim=2048, n_layers=16, mla_layers=(4, 8, 12, 16),
        dense_hidden=8192, attn_res_block_size=2,
        n_heads=16, head_dim=128,
        mla_n_heads=16, q_lora_rank=512, kv_lora_rank=256,
        n_experts=64, top_k=8, n_shared_experts=2, shared_hidden=768,
        latent_dim=1024, expert_hidden=768,
    ),
    "full": TitanMoEArgs(
        vocab_size=163840, dim=7168, n_layers=93, mla_layers=_every_fourth_and_last(93),
        dense_hidden=33792, attn_res_block_size=12,
        n_heads=96, head_dim=128,
        mla_n_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        n_experts=896, top_k=16, n_shared_experts=2, shared_hidden=3072,
        latent_dim=3584, expert_hidden=3072, max_seq_len=1 << 20,
    ),
}


# Vision tower sizes. full ≈ 0.41B in the ViT (27 × 1152, MoonViT/SigLIP-so400m shape) plus the
# merge projector into d; proxy is ViT-B-sized; debug runs on CPU in seconds.
VISION_FLAVORS: dict[str, VisionArgs] = {
    "debug": VisionArgs(),
    "proxy": VisionArgs(dim=768, n_layers=12, n_heads=12, mlp_hidden=3072,
                        max_patches=1024, window_patches=4096),
    "full": VisionArgs(dim=1152, n_layers=27, n_heads=16, mlp_hidden=4304,
                       max_patches=4096, window_patches=16384),
}


def model_args(flavor: str, /, **overrides: Any) -> TitanMoEArgs:
    """A copy of FLAVORS[flavor] with `overrides` (TitanMoEArgs fields; None = unset) applied,
    validated; one ConfigError naming the field otherwise."""
    if flavor not in FLAVORS:
        raise ConfigError(f"model.flavor = {flavor!r}: unknown flavor; allowed: {sorted(FLAVORS)}")
    return apply_overrides(dataclasses.replace(FLAVORS[flavor]), overrides)


def get_flavor(name: str) -> TitanMoEArgs:
    """A flavor's validated args, unchanged."""
    return model_args(name)
