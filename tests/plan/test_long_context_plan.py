"""The long-context terms of the plan against independent references: what full AC with
save_on_cpu keeps of a real CPU forward of the tiny model (on the device, by live storages; on
the host, by the saved-tensor hook), and the stage configs' plans."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac

from titan_moe.model import kda as kda_module
from titan_moe.model import mla as mla_module
from titan_moe.model import token_chunks
from titan_moe.model.args import ConfigError
from titan_moe.model.model import DecoderLayer, TitanMoE
from titan_moe.parallel.pipeline import boundary_tensors
from titan_moe.plan.cli import main
from titan_moe.plan.config import load_plan_config
from titan_moe.plan.layouts import fewest_gpus, layouts
from titan_moe.plan.memory import (
    DOC_ID_BYTES,
    activation_bytes,
    estimate,
    largest_recompute,
    parameter_counts,
)
from titan_moe.plan.saved import (
    _bf16_with_fp32_islands,
    ffn_chunk_bytes,
    layer_activation_bytes,
    mixer_segment_bytes,
    mla_segment_bytes,
    saved_bytes,
)

STAGES = Path(__file__).resolve().parents[2] / "configs" / "stages"


class _LiveStorages(TorchDispatchMode):
    """Every storage an op outputs, held weakly, but the parameters' (a weight's transpose is a
    view of it): what is still alive is what the step keeps."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # Meta tensors stand for the host copies (counted by the hook).
            if (isinstance(t, torch.Tensor) and not t.is_meta
                    and t.untyped_storage()._cdata not in self.skip):
                s = t.untyped_storage()
                self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def _layers_forward(tiny, offload: bool) -> tuple[int, int]:
    """(bytes the full-AC layers leave alive, bytes save_on_cpu would copy to the host) of a
    real bf16 CPU forward through the decoder layers, as TitanMoE.forward runs them."""
    torch.manual_seed(0)
    model = TitanMoE(tiny.args)
    model.init_weights()
    model.to(torch.bfloat16)
    apply_ac(model, ActivationCheckpoint(mode="full"))
    b, t = tiny.local_batch, tiny.seq_len
    tokens = torch.randint(tiny.args.vocab_size, (b, t))
    doc_ids = (torch.arange(t) // 40).to(torch.int32).expand(b, t).contiguous()
    host = 0

    def pack(x: torch.Tensor):
        nonlocal host
        host += x.untyped_storage().nbytes()
        return x.to("meta")  # the device copy is let go, as save_on_cpu lets it go

    mode = _LiveStorages(list(model.parameters()))
    with mode:
        partial = model.tok_embeddings(tokens)
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x) if offload
                 else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x))
        blocks: list[torch.Tensor] = []
        with hooks:
            for layer in model.layers.values():
                blocks, partial = layer(blocks, partial, doc_ids)
    del partial  # the last partial sum is the final site's input (the plan's tail)
    return mode.live_bytes(), host


@pytest.mark.parametrize("offload", [False, True])
def test_full_ac_layer_inputs_match_a_real_forward(tiny, offload):
    args, b, t = tiny.args, tiny.local_batch, tiny.seq_len
    stream = b * t * args.dim * 2
    device, host = _layers_forward(tiny, offload)
    # The plan's layer-input terms (activation_bytes without the loss and the recompute).
    if offload:
        # The last block list (the embedding and the finished blocks) stays on the device.
        want_device = (boundary_tensors(args.attn_res_block_size, args.n_layers) - 1) * stream
        want_host = args.n_layers * (stream + b * t * DOC_ID_BYTES)
    else:
        want_device, want_host = args.n_layers * stream, 0
    # Exact but for small storages the forward keeps (within 2%).
    assert device == pytest.approx(want_device, rel=0.02)
    assert host == pytest.approx(want_host, rel=0.02)


def test_offload_moves_layer_inputs_from_device_to_host(tiny):
    on, off = activation_bytes(replace(tiny, offload=True)), activation_bytes(tiny)
    stream = tiny.local_batch * tiny.seq_len * tiny.args.dim * 2
    assert off.host == 0 and on.host >= tiny.args.n_layers * stream
    assert on.device < off.device


def test_offload_needs_full_ac_and_names_the_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[training]\nactivation_offload = true\n'
                    '[activation_checkpoint]\nmode = "selective"\n')
    with pytest.raises(ConfigError, match="training.activation_offload"):
        load_plan_config(str(path))
    path.write_text('[training]\nloss_chunk = -1\n')
    with pytest.raises(ConfigError, match="training.loss_chunk"):
        load_plan_config(str(path))


def test_1m_stage_fits_on_the_layout_it_names_and_the_old_settings_did_not(capsys):
    cfg = load_plan_config(str(STAGES / "1m.toml"))
    best = fewest_gpus(cfg, 141)
    assert best is not None and best.fits(141)
    # The config names that layout's CP degree, and the plan of the config as written fits.
    assert best.cp == cfg.cp
    assert estimate(cfg, best.gpus, best.ep).fits(141)
    # One GPU's whole 1M sequence (CP 1), or the full-logits loss, does not fit on that count.
    assert not estimate(replace(cfg, cp=1), best.gpus, 1).fits(141)
    assert not estimate(replace(cfg, loss_chunk=0), best.gpus, best.ep).fits(141)
    # Nor does one GPU with the MoE in token chunks and the layer inputs offloaded, with or
    # without the mixers and the dense FFN by segments (the comment's numbers): without, layer
    # 0's recompute grows with T; with (MLA by key segments too), the largest is a KDA layer's.
    for segment in (0, 65536):
        one = replace(cfg, cp=1, offload=True,
                      args=replace(cfg.args, moe_token_chunk=65536, seq_segment=segment))
        assert not estimate(one, 1, 1).fits(141)
        assert largest_recompute(one)[0] == (14 if segment else 0)  # KDA layers
    assert main(["--config", str(STAGES / "1m.toml"), "--gpus", str(best.gpus)]) == 0
    assert f"fewest GPUs: {best.gpus}" in capsys.readouterr().out


def _layer(args, layer_id: int) -> DecoderLayer:
    torch.manual_seed(0)
    layer = DecoderLayer(layer_id, args)
    layer.init_weights()
    return _bf16_with_fp32_islands(layer)


def _piece_recomputes(args, layer_id: int, b: int, t: int, monkeypatch,
                      modules=(token_chunks,)) -> dict:
    """A real bf16 CPU forward+backward of a decoder layer under full AC whose sublayers run by
    checkpointed pieces: per module of `modules` (whose `checkpoint` is patched), the bytes each
    piece's recompute leaves alive (what its checkpoint then holds in backward), by live
    storages at its end (early stop off, so the recompute runs to its end)."""
    layer = _layer(args, layer_id)
    params = list(layer.parameters())
    held = {module: [] for module in modules}

    def measured(module):
        def piece(fn, x, *rest, **kwargs):
            def run(x, *rest):
                mode = _LiveStorages(params + [x])  # x: a view of the sublayer's input
                with mode:
                    out = fn(x, *rest)
                outs = out if isinstance(out, tuple) else (out,)
                held[module].append(mode.live_bytes()
                                    - sum(o.untyped_storage().nbytes() for o in outs))
                return out

            return checkpoint(run, x, *rest, **kwargs)

        return piece

    for module in modules:
        monkeypatch.setattr(module, "checkpoint", measured(module))
    sources = [torch.randn(b, t, args.dim, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(boundary_tensors(args.attn_res_block_size, layer_id))]
    with set_checkpoint_early_stop(False):
        _, out = checkpoint(layer, sources[:-1], sources[-1], None, use_reentrant=False)
        out.float().square().sum().backward()
    return held


def test_moe_chunk_recompute_matches_a_real_backward(tiny, monkeypatch):
    args, b, t, chunk = tiny.args, tiny.local_batch, tiny.seq_len, 48  # 128 tokens: 48, 48, 32
    # Layer 1: KDA + MoE.
    held = _piece_recomputes(replace(args, moe_token_chunk=chunk), 1, b, t, monkeypatch)
    held = held[token_chunks]
    # Forward (its saves go to the checkpoint: nothing held), the full-AC recompute (the same),
    # then each chunk's recompute in backward, the last chunk first.
    assert len(held) == 9 and max(held[:6]) < min(held[6:])
    # Independent reference: what a saved-tensor hook sees the same layer, unchunked, save
    # over one chunk's tokens in an ordinary real forward; equal to the byte.
    moe = _layer(args, 1).ffn
    x = torch.randn(chunk, args.dim, dtype=torch.bfloat16, requires_grad=True)
    real_chunk = saved_bytes(lambda: moe(x[None]), list(moe.parameters()) + [x]).total
    assert max(held) == real_chunk
    x_all = torch.randn(b * t, args.dim, dtype=torch.bfloat16, requires_grad=True)
    real_all = saved_bytes(lambda: moe(x_all[None]), list(moe.parameters()) + [x_all]).total
    # The plan (CUDA kernels' saves, lower than CPU eager's) scales from T to a chunk as the
    # real backward does (seen 0.407 and 0.400; 5%: the fixed per-chunk terms, the dispatch
    # padding and the router's histogram, are a different share of each).
    planned = ffn_chunk_bytes(args, 1, chunk).total / ffn_chunk_bytes(args, 1, b * t).total
    assert planned == pytest.approx(max(held) / real_all, rel=0.05)
    # And the plan's MoE layer holds that chunk in place of the whole layer's expert buffers.
    chunked = layer_activation_bytes(replace(args, moe_token_chunk=chunk), 1, b, t).total
    whole = layer_activation_bytes(args, 1, b, t).total
    assert chunked == whole - ffn_chunk_bytes(args, 1, b * t).total + ffn_chunk_bytes(
        args, 1, chunk).total


def test_seq_segment_recomputes_match_a_real_backward(tiny, monkeypatch):
    # Layer 0 (KDA + dense FFN) over 2 rows of 192 positions: 3 KDA segments of 64 positions
    # each row, 6 FFN chunks of 64 of the 384 tokens.
    args, b, t, segment = tiny.args, tiny.local_batch, 192, 64
    segmented = replace(args, seq_segment=segment)
    held = _piece_recomputes(segmented, 0, b, t, monkeypatch, (kda_module, token_chunks))
    mixer_held, ffn_held = held[kda_module], held[token_chunks]
    # Forward and the full-AC recompute hold nothing (but a segment's incoming state), then
    # each piece's recompute in backward, the last first.
    assert len(mixer_held) == 9 and max(mixer_held[:6]) < min(mixer_held[6:])
    assert len(ffn_held) == 18 and max(ffn_held[:12]) == 0 < min(ffn_held[12:])
    # Independent references: what a saved-tensor hook sees the whole sublayers save over one
    # piece in an ordinary real forward. The FFN chunk's: equal to the byte.
    whole = _layer(args, 0)
    x = torch.randn(segment, args.dim, dtype=torch.bfloat16, requires_grad=True)
    assert max(ffn_held) == saved_bytes(lambda: whole.ffn(x[None]),
                                        list(whole.ffn.parameters()) + [x]).total
    # The first segment's (no state, no halo): the mixer's saves and the one copy that makes
    # a segment of 2 rows (a strided view) contiguous, to the byte.
    mixer = whole.mixer

    def mixer_saves(positions: int) -> int:
        x = torch.randn(b, positions, args.dim, dtype=torch.bfloat16, requires_grad=True)
        return saved_bytes(lambda: mixer(x), list(mixer.parameters()) + [x]).total

    copy = b * segment * args.dim * 2
    assert mixer_held[-1] == mixer_saves(segment) + copy
    # The later ones add the incoming state and the conv's 3 halo rows: at most 3 / 64 more.
    state = b * args.n_heads * args.head_dim**2 * 4
    assert mixer_held[-1] < max(mixer_held) <= mixer_held[-1] * (1 + 3 / segment) + state
    # The plan (CUDA kernels' saves) scales from T to a segment as the real backward does
    # (seen 0.333 and 0.341).
    planned = (mixer_segment_bytes(args, 0, b, segment).total
               / mixer_segment_bytes(args, 0, b, t).total)
    assert planned == pytest.approx(max(mixer_held) / mixer_saves(t), rel=0.05)


def test_seq_segment_pieces_replace_the_whole_sublayers_in_the_plan(tiny):
    """A hand count of the plan's layer 0 with segments: its saves unsegmented, less the whole
    mixer's and FFN's, plus the larger piece's recompute and what the segments' checkpoints
    save besides views of the layer's tensors: each later segment's incoming state (fp32
    [B,H,K,V]) and conv taps (q, k and v: [B, conv - 1, H·K] bf16)."""
    args, b, t, segment = tiny.args, tiny.local_batch, 192, 64
    whole = layer_activation_bytes(args, 0, b, t)
    got = layer_activation_bytes(replace(args, seq_segment=segment), 0, b, t)
    inner = args.n_heads * args.head_dim
    carried = (t // segment - 1) * (b * args.n_heads * args.head_dim**2 * 4
                                    + 3 * b * (args.kda_conv_size - 1) * inner * 2)
    pieces = [mixer_segment_bytes(args, 0, b, segment), ffn_chunk_bytes(args, 0, segment)]
    one = max(pieces, key=lambda piece: piece.recompute)
    assert got.total == (whole.total - mixer_segment_bytes(args, 0, b, t).total
                         - ffn_chunk_bytes(args, 0, b * t).total + one.total + carried)
    # The KDA op's backward workspace is one segment's.
    assert got.workspace == pieces[0].workspace < whole.workspace


def test_mla_segment_recompute_matches_a_real_backward(tiny, monkeypatch):
    # Layer 2 (MLA) over 2 rows of 192 positions: query segments of 64 against 64, 128 and 192
    # keys, by key segments of 64.
    args, b, t, segment = tiny.args, tiny.local_batch, 192, 64
    held = _piece_recomputes(replace(args, seq_segment=segment), 2, b, t, monkeypatch,
                             (mla_module,))[mla_module]
    # The latents [c_kv | k_rope] of all t positions, an input of every segment, count once an
    # op inside views them (the key segments' slices). Forward and the full-AC recompute hold
    # nothing else, then each segment's recompute in backward, the last first: the same for
    # every segment, however many keys (the attention keeps q, its output and lse, no key).
    latent_bytes = b * t * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    assert len(held) == 9 and held[:6] == [latent_bytes] * 6
    assert held[6] == held[7] == held[8] > latent_bytes
    # Reference: what a saved-tensor hook sees the last segment's real forward save, the keys'
    # latents of all t positions given, and the one copy that makes a segment of 2 rows (a
    # strided view) contiguous; to the byte: the recompute holds nothing but its saves.
    mixer = _layer(replace(args, seq_segment=segment), 2).mixer
    latent = torch.randn(b, t, mixer.kv_lora + mixer.rope, dtype=torch.bfloat16,
                         requires_grad=True)
    c_kv, k_rope = latent.split([mixer.kv_lora, mixer.rope], dim=-1)
    x = torch.randn(b, segment, args.dim, dtype=torch.bfloat16, requires_grad=True)
    copy = b * segment * args.dim * 2
    saves = saved_bytes(lambda: mixer._query_segment(x, None, c_kv, k_rope, None),
                        list(mixer.parameters()) + [x, latent]).total
    assert held[6] == saves + copy + latent_bytes


def test_mla_segments_replace_the_whole_mixer_in_the_plan(tiny):
    """A hand count of the plan's MLA layer with segments: its saves unsegmented, less the whole
    mixer's, plus the latents [c_kv | k_rope] the segments' checkpoints save and the last
    segment's recompute, which grows by a fixed cost a query and not with the keys; its
    attention's backward workspace grows with the keys by the latents' gradient only."""
    args, b, t, segment = tiny.args, tiny.local_batch, 192, 64
    whole = layer_activation_bytes(args, 2, b, t)
    got = layer_activation_bytes(replace(args, seq_segment=segment), 2, b, t)
    latent = b * t * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    mixer = mixer_segment_bytes(args, 2, b, t).total  # the whole mixer over t positions
    last = mla_segment_bytes(args, 2, b, segment, t)
    assert got.total == whole.total - mixer + latent + last.total
    by_keys = [mla_segment_bytes(args, 2, b, segment, n) for n in (64, 192, 256, 320)]
    assert len({piece.total for piece in by_keys}) == 1
    key_gradient = b * segment * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    workspaces = [piece.workspace for piece in by_keys]
    assert workspaces[3] - workspaces[2] == workspaces[2] - workspaces[1] == key_gradient
    by_queries = [mla_segment_bytes(args, 2, b, n, t).total for n in (64, 128, 192)]
    assert by_queries[2] - by_queries[1] == by_queries[1] - by_queries[0] > 0


def test_seq_segment_excludes_context_parallel_layouts(tmp_path):
    path = tmp_path / "seg.toml"
    path.write_text('[titan_moe]\nseq_segment = 64\n[training]\nseq_len = 256\n'
                    '[parallelism]\ncontext_parallel_degree = 2\n')
    with pytest.raises(ConfigError, match="parallelism.context_parallel_degree"):
        load_plan_config(str(path))
    path.write_text('[titan_moe]\nseq_segment = 64\n[training]\nseq_len = 256\n')
    cfg = load_plan_config(str(path))
    assert {e.cp for e in layouts(cfg, 8, parameter_counts(cfg.args), {})} == {1}


def test_saving_norms_drop_the_sites_outputs_from_every_layers_saves(tiny):
    """With norm_saves_output the two input norms save their outputs, which the mixer and the
    FFN (whole, or their segments' and chunks' checkpoints) save anyway: a layer's plan loses
    its AttnRes sites' outputs, b·t·d bf16 bytes each, and nothing else. Layer 0 has one site:
    its mixer norm reads the layer's input (the embedding), which no layer's saves count."""
    args, b, t = tiny.args, tiny.local_batch, 192
    for pieces in (args, replace(args, seq_segment=64, moe_token_chunk=128)):
        for layer_id in range(args.n_layers):
            off = layer_activation_bytes(pieces, layer_id, b, t).total
            on = layer_activation_bytes(replace(pieces, norm_saves_output=True), layer_id, b, t)
            sites = 1 if layer_id == 0 else 2
            assert off - on.total == sites * b * t * args.dim * 2, (layer_id, pieces.seq_segment)
