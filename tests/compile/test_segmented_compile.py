"""apply_compile keeps the KDA and MLA mixers' sequence segments bounding their backward: the
backward's peak grows with the positions by what the design holds, not by every segment's
recompute.

Compiled whole (one Inductor graph with a checkpoint HOP per segment), a KDA mixer's backward
held several segments' recomputes at once: from 4 to 8 segments of 128 positions (d = 256,
CPU, fp32) its peak grew by 18.7 rows of d a position, compiled per segment by 1 (the input
gradient), and an MLA mixer's by 25.1 against 6.3 (the eager loop's: 1 and 8.9), 2.0 since its
attention runs by key segments. Memory is
read from the profiler's CPU allocation events (backward_peak.py); the KDA recurrence is the
CPU reference (chunk_kda_torch), compiled inside the segment.
"""

import copy
from collections.abc import Iterator

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.compile.backward_peak import backward_peak
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.args import TitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.parallelize import apply_compile

SEGMENT = 128
# The most segments any test here runs: every input is (a slice of) a row of as many positions,
# so all share one set of strides and the compiled segments serve every test without a recompile.
MAX_SEGMENTS = 8
LAYER = {"kda": "0", "mla": "1"}
# Rows of d an added position may add to the backward's peak. KDA: its input gradient (the
# segment's and the concatenation's) and the incoming gradient, 3 (as for MoE chunks); measured
# 1 by segments, 18.7 compiled whole. MLA by key segments (ops/key_segment_attention.py): the
# input gradient (1), the latents (kv_lora + rope = 128 channels, 0.5 row: recomputed by full
# AC) and their gradient (0.5), with 1 row of slack: 3; measured 2.0. Up-projecting each
# query segment's whole prefix (its keys, values, their gradients and CPU SDPA's mask over
# them growing with the positions) measured 6.3, compiled whole 25.1.
ROWS_PER_POSITION = {"kda": 3, "mla": 3}


class FullAC(torch.nn.Module):
    """The mixer under a checkpoint of its own, as full AC runs it: its backward starts with the
    recompute of every segment's forward (each saving its inputs only), which must not keep a
    segment's intermediates alive (a compiled segment's conv taps, views of its whole conv
    inputs, once did: 3 more rows a position)."""

    def __init__(self, mixer: torch.nn.Module):
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mixer, x, use_reentrant=False)


@pytest.fixture(scope="module")
def mixers() -> Iterator[dict[str, tuple[torch.nn.Module, torch.nn.Module]]]:
    """kind -> (eager mixer, compiled mixer) of one two-layer model by segments of SEGMENT
    (layer 0 KDA, layer 1 MLA), compiled once for every test here."""
    args = TitanMoEArgs(
        vocab_size=64, dim=256, n_layers=2, mla_layers=(2,), n_dense_layers=1, n_experts=4,
        top_k=2, seq_segment=SEGMENT,
    ).validate()
    torch._dynamo.reset()  # no segment function compiled by an earlier test is reused
    torch.manual_seed(0)
    model = TitanMoE(args)
    model.init_weights()
    eager = {kind: copy.deepcopy(model.layers[layer].mixer) for kind, layer in LAYER.items()}
    apply_compile(model, "inductor", set())
    # The mixers compile lazily, in the tests: patched for all.
    with scalar_cpp():
        yield {kind: (eager[kind], model.layers[layer].mixer) for kind, layer in LAYER.items()}


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_compiled_mixer_segments_bound_the_backward(mixers, kind):
    mixer = FullAC(mixers[kind][1])
    dim = mixer.mixer.w_o.out_features
    short, long = (backward_peak(mixer, n * SEGMENT, dim, MAX_SEGMENTS * SEGMENT) for n in (4, 8))
    allowed = ROWS_PER_POSITION[kind] * 4 * dim * 4 * SEGMENT
    assert long - short <= allowed, (short, long, allowed)


# float32, Inductor's kernels against eager autograd: sums reordered only.
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("segments", [1, 4])
def test_compiled_segments_match_the_eager_mixer(mixers, kind, segments):
    """Per segment (and, over one segment, KDA's whole body) the compiled mixer computes what the
    eager one does: outputs and input gradients."""
    eager, compiled = mixers[kind]
    dim = eager.w_o.out_features
    row = torch.randn(1, MAX_SEGMENTS * SEGMENT, dim)
    results = []
    for mixer in (eager, compiled):
        xi = row[:, :segments * SEGMENT].detach().requires_grad_()
        y = mixer(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
