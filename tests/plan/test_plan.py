"""The memory plan's arithmetic against hand counts at tiny size."""

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from titan_moe.model.model import TitanMoE
from titan_moe.plan import saved
from titan_moe.plan.cli import main
from titan_moe.plan.layouts import ep_degrees, fewest_gpus
from titan_moe.plan.memory import (
    GB,
    HEADROOM,
    Activations,
    ParamCounts,
    activation_bytes,
    estimate,
    parameter_counts,
)
from titan_moe.plan.op_workspace import attn_res_backward_workspace, kda_backward_workspace
from titan_moe.plan.saved import head_activation_bytes, layer_activation_bytes, saved_bytes


def test_saved_bytes_counts_each_storage_once_and_skips_excluded():
    lin1, lin2 = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    params = [lin1.weight, lin2.weight]
    # Linear saves its input (3·8 fp32 = 96 B) and weight (excluded); relu its output (3·4·4).
    assert saved_bytes(lambda: lin1(x), params) == (96, 96, 0)
    assert saved_bytes(lambda: lin1(x) + lin2(x), params) == (96, 96, 0)
    assert saved_bytes(lambda: torch.relu(lin1(x)), params) == (96 + 48, 96, 0)
    assert saved_bytes(lambda: lin1(x), params + [x]) == (0, 0, 0)


def test_parameter_counts_match_the_model(tiny):
    counts = parameter_counts(tiny.args)
    model = TitanMoE(tiny.args)
    assert counts.total == sum(p.numel() for p in model.parameters())
    # Two MoE layers × (w1, w3: 8·32·32, w2: 8·32·32).
    assert counts.experts == 2 * 3 * 8 * 32 * 32
    assert counts.largest_layer_experts == 3 * 8 * 32 * 32
    assert counts.output == counts.embedding == 128 * 64


def test_estimate_arithmetic_by_hand(tiny):
    counts = ParamCounts(total=8000, experts=6000, embedding=100, output=100,
                         largest_layer_dense=300, largest_layer_experts=2000)
    e = estimate(tiny, gpus=4, ep=2, counts=counts, activations=Activations(5000.0, 0.0))
    assert (e.parameters, e.gradients, e.optimizer) == (8000.0, 8000.0, 16000.0)
    assert e.working == 10 * (300 + 2000 / 2) + 2 * 100
    assert e.peak == 8000 + 16000 + 13200 + max(5000, 8000)


def test_full_ac_activations_compose_as_documented(tiny):
    args, b, t = tiny.args, tiny.local_batch, tiny.seq_len
    stream, v = b * t * args.dim * 2, args.vocab_size
    layers = [layer_activation_bytes(args, i, b, t) for i in range(args.n_layers)]
    transient = max(max(2 * s.largest, s.workspace) for s in layers)
    recompute = max(s.total + max(2 * s.largest, s.workspace) for s in layers)
    head = head_activation_bytes(args, b, t).total
    n_blocks = 2  # 3 layers in AttnRes blocks of 2
    tail = 2 * stream + head
    want = 3 * stream + tail + max(12 * b * t * v, recompute + (n_blocks + 1) * stream)
    assert activation_bytes(tiny) == (want, 0)
    # Without AC the backward of a layer runs on top of everything saved; here the KDA op's
    # workspace is larger than the full logits' loss phase, so it sets the peak.
    assert transient > 12 * b * t * v
    no_ac = replace(tiny, ac_mode="none")
    assert activation_bytes(no_ac) == (sum(s.total for s in layers) + 3 * stream + tail
                                       + transient, 0)


def test_a_layers_recompute_holds_its_largest_op_workspace(tiny):
    # The KDA op's and each AttnRes site's backward workspace; the largest is the layer's.
    # Layer 0 (KDA) has no mixer site and its FFN site reads the embedding and its mixer's
    # output (2 sources: it starts a block); layer index 2 (MLA, no workspace of its own at this
    # size) starts a block too: its mixer site reads the embedding and block 1 (2), its FFN site
    # those and its mixer's output (3).
    args, b, t = tiny.args, tiny.local_batch, tiny.seq_len
    kda_layer = layer_activation_bytes(args, 0, b, t)
    mla_layer = layer_activation_bytes(args, 2, b, t)
    kda = kda_backward_workspace(b, t, args.n_heads, args.head_dim, args.head_dim)
    site = {n: attn_res_backward_workspace(b * t, args.dim, (torch.bfloat16,) * n, torch.bfloat16)
            for n in (2, 3)}
    assert site[2] < site[3]
    assert kda_layer.workspace == max(kda, site[2])
    assert mla_layer.workspace == site[3]
    assert kda_layer.recompute == kda_layer.total + max(2 * kda_layer.largest, kda, site[2])


def test_a_kda_layer_saves_what_its_op_keeps_for_the_backward(tiny, monkeypatch):
    """The KDA op's forward keeps its chunk matrices, G, W, K_d, states and Ṽ for the backward
    (op_workspace.kda_kept_buffers): the layer's saves count them. By hand at K = V = 32, bf16
    inputs: 3 · 64 · 4 (A_qk, KK, Tinv) + 32 · 4 (G) + 2 · 32 · 2 (W, K_d) + 32 · 32 · 2 / 64
    (the states, one bf16 [K, V] a chunk) + 32 · 2 (Ṽ) = 1,120 B a token and head."""
    args, b, t = tiny.args, tiny.local_batch, tiny.seq_len
    assert args.head_dim == 32 and t % 64 == 0
    with_kept = layer_activation_bytes(args, 0, b, t).total
    monkeypatch.setattr(saved, "kda_kept_buffers", lambda *args, **kwargs: ())
    assert with_kept - layer_activation_bytes(args, 0, b, t).total == 1120 * b * t * args.n_heads


def test_layer_activations_scale_with_tokens(tiny):
    args = tiny.args
    dense, moe = (layer_activation_bytes(args, i, 2, 64) for i in (0, 1))
    assert moe.total > 0 and dense.total > 0
    assert layer_activation_bytes(args, 1, 4, 64).total == pytest.approx(2 * moe.total, rel=0.05)


def test_ep_degrees_divide_gpus_and_experts():
    assert ep_degrees(16, 896) == [1, 2, 4, 8, 16]
    assert ep_degrees(24, 896) == [1, 2, 4, 8]


def test_fewest_gpus_is_the_first_count_that_fits(tiny):
    # Halfway between what one GPU needs and the floor that sharding cannot go below (the
    # activations and working buffers are per GPU), so one GPU is too few and some count fits.
    one, floor = estimate(tiny, 1, 1), estimate(tiny, 1 << 16, 8)
    gpu_mem = (one.peak + floor.peak) / 2 / GB / HEADROOM
    best = fewest_gpus(tiny, gpu_mem)
    assert best is not None and best.gpus > 1 and best.fits(gpu_mem)
    smaller = [n for n in (1, 2, 4) if n < best.gpus]
    assert all(not estimate(tiny, n, ep).fits(gpu_mem)
               for n in smaller for ep in ep_degrees(n, 8))


def test_cli_errors_on_a_missing_config(capsys):
    assert main(["--config", "missing.toml"]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_kda_layers_are_counted_as_the_triton_op_not_the_pytorch_path(tiny, monkeypatch):
    # The plan is for CUDA, where the Triton op saves only its inputs; the PyTorch chunk path
    # saves per-chunk states and would inflate the plan several-fold.
    import titan_moe.ops.kda as kda_ops

    def forbidden(*args, **kwargs):
        raise AssertionError("the memory plan ran the PyTorch KDA path")

    monkeypatch.setattr(kda_ops, "chunk_kda_torch", forbidden)
    assert layer_activation_bytes(tiny.args, 0, 2, 64).total > 0
