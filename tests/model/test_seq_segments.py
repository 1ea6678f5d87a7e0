"""Sequence segments (titan_moe.seq_segment): the KDA mixer by segments of positions, the MLA
mixer by query segments and the dense FFN by chunks of tokens, each under its own checkpoint,
against the same sublayers run whole (the independent reference), in float64 on CPU: outputs
and every gradient (input and parameters) agree to SEGMENT_TOL of the largest magnitude. The
segmented model still traces with torch.compile(fullgraph=True) and matches eager. MLA's
backward peak grows with the positions by their gradients only (backward_peak.py)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.compile.backward_peak import backward_peak
from tests.ops.test_key_segment_attention import fake_flash_backward, fake_flash_forward
from titan_moe.model import kda as kda_module
from titan_moe.model import mla as mla_module
from titan_moe.model import token_chunks
from titan_moe.model.args import TitanMoEArgs, get_flavor
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.model import DecoderLayer, TitanMoE
from titan_moe.model.situ_glu import SiTUGLU
from titan_moe.ops import segment_pair_attention as pair_module
from titan_moe.parallel.context_parallel import apply_context_parallel

# float64, relative to each tensor's largest magnitude (at least 1): seen 1.7e-15 (1.9e-13
# absolute; weight-gradient sums ordered by segment). Dropping the state's restart at a
# document that starts on a segment boundary gives 56 absolute. MLA: seen 2.1e-15 (7.1e-13
# absolute); the latent_prefix seam's forward: 0.
SEGMENT_TOL = 1e-12
# float32, eager against the compiled (aot_eager) model, relative: seen 0.
COMPILE_TOL = 1e-6
B, T, SEG = 2, 160, 64  # segments of 64, 64 and a partial 32


def _args(**overrides) -> TitanMoEArgs:
    # Weights of std 0.3 (not 0.02): every term of the layer well above rounding.
    return dataclasses.replace(get_flavor("debug"), dim=32, n_heads=2, head_dim=16,
                               kda_gate_rank=8, dense_hidden=48, init_std=0.3,
                               **overrides).validate()


def _documents() -> torch.Tensor:
    """Row 0: documents start exactly on the boundary at 64, and at 100 inside a segment. Row
    1: a document crosses the boundary at 64, the next starts exactly on the one at 128."""
    doc = torch.zeros(B, T, dtype=torch.int32)
    doc[0, 64:], doc[0, 100:] = 1, 2
    doc[1, 30:], doc[1, 128:] = 1, 2
    return doc


def _kda(args: TitanMoEArgs) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(args)
    layer.init_weights(args.init_std, args.init_std)
    return layer


def _mla(args: TitanMoEArgs) -> GatedMLA:
    layer = GatedMLA(args)
    layer.init_weights(args.init_std, args.init_std)
    return layer


def _layer0(args: TitanMoEArgs) -> DecoderLayer:
    layer = DecoderLayer(0, args)
    layer.init_weights()
    # The AttnRes query starts at 0, where its gain's gradient is exactly 0.
    torch.nn.init.normal_(layer.ffn_site.query, std=0.3)
    return layer


def _twins(make):
    """The same float64 module run whole and by segments (seq_segment = SEG)."""
    torch.manual_seed(0)
    whole = make(_args()).double()
    segmented = make(_args(seq_segment=SEG)).double()
    segmented.load_state_dict(whole.state_dict())
    return whole, segmented


def _step(module, inputs, grad_out, outer_ac: bool = False) -> list[torch.Tensor]:
    """The output, then the gradients of the input that needs them and of every parameter."""
    x = next(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)
    params = [x, *module.parameters()]
    out = checkpoint(module, *inputs, use_reentrant=False) if outer_ac else module(*inputs)
    out = out[1] if isinstance(out, tuple) else out  # a decoder layer: the partial sum
    return [out, *torch.autograd.grad((out * grad_out).sum(), params)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = max(1.0, w.abs().max().item())
        assert (g - w).abs().max().item() <= tol * scale, i
    assert all(w.abs().max().item() > 0 for w in want[1:])  # every gradient is exercised


def _count_checkpoints(monkeypatch, module) -> list[int]:
    """The lengths (dim 1 for mixer segments, dim 0 for token chunks) module's checkpoints run."""
    sizes = []

    def counted(fn, x, *args, **kwargs):
        sizes.append(x.shape[0] if module is token_chunks else x.shape[1])
        return checkpoint(fn, x, *args, **kwargs)

    monkeypatch.setattr(module, "checkpoint", counted)
    return sizes


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "no-doc-ids"])
@pytest.mark.parametrize(("make", "module"), [(_kda, kda_module), (_mla, mla_module)],
                         ids=["kda", "mla"])
def test_mixer_segments_match_the_whole_layer(make, module, documents, monkeypatch):
    whole, segmented = _twins(make)
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    doc = _documents() if documents else None
    grad_out = torch.randn(B, T, 32, dtype=torch.float64)
    want = _step(whole, (x, doc), grad_out)
    sizes = _count_checkpoints(monkeypatch, module)
    got = _step(segmented, (x, doc), grad_out)
    assert sizes == [64, 64, 32]
    _assert_close(got, want, SEGMENT_TOL)


def test_mla_segments_attend_by_key_segments(monkeypatch):
    """Each query segment's keys are up-projected one key segment (at most SEG positions) at a
    time: its own positions last, the earlier ones counted back from it."""
    _, segmented = _twins(_mla)
    shapes = []
    project = mla_module.LatentKeys.project

    def recorded(inputs, weights, options):
        shapes.append(inputs[0].shape[1])
        return project(inputs, weights, options)

    monkeypatch.setattr(mla_module.LatentKeys, "project", staticmethod(recorded))
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    segmented(x, _documents()).sum().backward()
    # Key segment lengths: forward, then each query segment's recompute and backward (its
    # keys projected again), the last first.
    assert shapes == [64, 64, 64, 64, 64, 32, *[64, 64, 32] * 2, *[64, 64] * 2, *[64] * 2]


def test_mla_segments_keep_the_latent_prefix_seam():
    """Context parallelism's seam: latent_prefix puts an earlier shard's keys before x's. By
    segments x's queries still see their whole causal prefix: the whole layer over both."""
    whole, segmented = _twins(_mla)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    doc, cut = _documents(), 48  # x[:, 48:] is this shard: segments of 64 and 48
    earlier = segmented.w_kva(x[:, :cut])
    segmented.latent_prefix = lambda latent, _: (
        *torch.cat([earlier, latent], 1).split([segmented.kv_lora, segmented.rope], -1), doc)
    with torch.no_grad():
        got = segmented(x[:, cut:], doc[:, cut:])
        want = whole(x, doc)[:, cut:]
    _assert_close([got], [want], SEGMENT_TOL)


def test_decoder_layer_segments_match_inside_full_ac(monkeypatch):
    """Layer 0 (KDA mixer, dense FFN) under a full-AC checkpoint, as the trainer runs it: its
    recompute re-runs the segments' and the chunks' checkpoints."""
    whole, segmented = _twins(_layer0)
    partial = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, T, 32, dtype=torch.float64)
    want = _step(whole, ([], partial, _documents()), grad_out)
    segments = _count_checkpoints(monkeypatch, kda_module)
    chunks = _count_checkpoints(monkeypatch, token_chunks)
    got = _step(segmented, ([], partial, _documents()), grad_out, outer_ac=True)
    # Forward, then the recompute: 3 segments of each row, 5 chunks of the 320 tokens.
    assert segments == [64, 64, 32] * 2 and chunks == [64] * 10
    _assert_close(got, want, SEGMENT_TOL)


def test_dense_ffn_chunks_match_the_unchunked_ffn(monkeypatch):
    torch.manual_seed(0)
    whole = SiTUGLU(12, 40).double()
    whole.init_weights(0.3, 0.3)
    chunked = SiTUGLU(12, 40, token_chunk=8).double()
    chunked.load_state_dict(whole.state_dict())
    x = torch.randn(2, 11, 12, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 11, 12, dtype=torch.float64)
    want = _step(whole, (x,), grad_out)
    sizes = _count_checkpoints(monkeypatch, token_chunks)
    got = _step(chunked, (x,), grad_out)
    assert sizes == [8, 8, 6]
    _assert_close(got, want, SEGMENT_TOL)


@pytest.mark.parametrize("make", [_kda, _mla], ids=["kda", "mla"])
def test_decoding_ignores_segments(make):
    # The decode path carries its own state: a prefill through it equals the whole forward.
    whole, segmented = _twins(make)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    with torch.no_grad():
        got = segmented(x, cache=segmented.new_cache(B))
        want = whole(x)
    assert (got - want).abs().max().item() <= SEGMENT_TOL * want.abs().max().item()


def test_context_parallelism_rejects_segments():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TitanMoE(_args(seq_segment=SEG))
    with pytest.raises(ValueError, match="titan_moe.seq_segment = 64"):
        apply_context_parallel(model, group=None)


def test_segmented_model_compiles_fullgraph_and_matches_eager():
    """The whole tiny model (KDA + dense FFN, MLA + MoE) by one torch.compile(fullgraph=True):
    Dynamo traces the segments' and chunks' checkpoints as HOPs and AOTAutograd partitions them
    (aot_eager: Inductor's code for the same graph takes a minute and a half on 2 CPU cores)."""
    args = TitanMoEArgs(
        vocab_size=128, dim=32, n_layers=2, mla_layers=(2,), n_dense_layers=1, dense_hidden=64,
        n_heads=2, head_dim=16, kda_gate_rank=8, mla_n_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=8,
        top_k=2, shared_hidden=16, latent_dim=16, expert_hidden=16, qb_bins=64, max_seq_len=T,
        seq_segment=SEG,
    ).validate()
    torch.manual_seed(0)
    model = TitanMoE(args)
    model.init_weights()
    for module in model.modules():  # queries off 0, where their gains' gradients are exactly 0
        if isinstance(module, AttnResSite):
            torch.nn.init.normal_(module.query, std=0.3)
    tokens = torch.randint(args.vocab_size, (1, T + 1))
    doc = _documents()[:1]

    def run(forward) -> list[torch.Tensor]:
        logits = forward(tokens[:, :-1], doc)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

    want = run(model)
    torch._dynamo.reset()  # no frame compiled by an earlier test in this process is reused
    got = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    _assert_close(got, want, COMPILE_TOL)


def test_mla_backward_peak_grows_by_the_gradients_only():
    """By key segments, an MLA mixer's backward holds one key segment's keys and values: from 4
    to 8 query segments of 128 (d = 256, fp32, eager) its peak grows by what every position
    needs, the input's gradient (1 row of d) and the latents' (kv_lora + rope = 128 channels,
    0.5): measured 1.5 rows a position. Up-projecting each query segment's whole prefix, the
    last segment's keys, values, their gradients and the mask over them grew it by 8.9."""
    segment = 128
    args = TitanMoEArgs(vocab_size=64, dim=256, n_layers=2, mla_layers=(2,),
                        n_dense_layers=1, n_experts=4, top_k=2, seq_segment=segment).validate()
    torch.manual_seed(0)
    mixer = GatedMLA(args)
    mixer.init_weights(0.02, 0.02)
    short, long = (backward_peak(mixer, n * segment, args.dim) for n in (4, 8))
    latent_rows = (args.kv_lora_rank + args.qk_rope_head_dim) / args.dim
    allowed = (1 + latent_rows + 0.5) * 4 * args.dim * 4 * segment  # 0.5 row: slack
    assert long - short <= allowed, (short, long, allowed)


def test_mla_segments_through_the_flash_layout(monkeypatch):
    """The MLA mixer by segments through the CUDA path's varlen layout (Flash's kernels replaced
    by their per-sequence definition, tests/ops/test_key_segment_attention.py) still equals the
    whole layer."""
    monkeypatch.setattr(pair_module, "flash_eligible", lambda q: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake_flash_backward)
    whole, segmented = _twins(_mla)
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, T, 32, dtype=torch.float64)
    want = _step(whole, (x, _documents()), grad_out)
    _assert_close(_step(segmented, (x, _documents()), grad_out), want, SEGMENT_TOL)
