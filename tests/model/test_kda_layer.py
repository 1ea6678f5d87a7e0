"""The KDA layer hands the recurrence its inputs in the projections' dtype.

Under bf16 autocast the residual stream is fp32 but the projections are bf16; fp32 inputs would
send the CUDA kernels down their IEEE fp32 path (several times slower, minutes to compile), so
q, k, v must reach the recurrence in bf16. The output must still match the fp32 layer (float64
reference) to bf16 accuracy: relative RMS 2e-2, the GPU suite's gradient bound.
"""

import dataclasses

import pytest
import torch

from titan_moe.model.args import get_flavor
from titan_moe.model.kda import KimiDeltaAttention


def layer_and_input(dtype=torch.float32):
    torch.manual_seed(0)
    args = dataclasses.replace(get_flavor("debug"), kda_backend="auto")
    layer = KimiDeltaAttention(args).to(dtype)
    layer.init_weights(0.02, 0.02)
    x = torch.randn(2, 96, args.dim, dtype=dtype)
    doc_ids = (torch.arange(96) >= 40).to(torch.int32).expand(2, -1).contiguous()
    return layer, x, doc_ids


@pytest.mark.parametrize("autocast", [False, True])
def test_recurrence_gets_the_projection_dtype(monkeypatch, autocast):
    layer, x, doc_ids = layer_and_input()
    seen = {}
    real = KimiDeltaAttention.sequence_recurrence

    def recording(q, k, v, *rest, **kwargs):
        seen.update(q=q.dtype, k=k.dtype, v=v.dtype)
        return real(q, k, v, *rest, **kwargs)

    monkeypatch.setattr(KimiDeltaAttention, "sequence_recurrence", staticmethod(recording))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(x, doc_ids)
    want = torch.bfloat16 if autocast else torch.float32
    assert seen == {"q": want, "k": want, "v": want}


def test_bf16_autocast_layer_matches_float64():
    layer, x, doc_ids = layer_and_input()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x, doc_ids).double()
    want = layer.double()(x.double(), doc_ids)
    rel_rms = ((got - want).norm() / want.norm()).item()
    assert rel_rms <= 2e-2, rel_rms
