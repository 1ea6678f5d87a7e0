"""Block AttnRes against an independent reference: the uniform mean at init, softmax mix after."""

import torch

from titan_moe.model.attn_res import AttnResSite

TOL = 1e-12  # float64


def test_attn_res_at_init_is_mean_of_sources():
    torch.manual_seed(0)
    site = AttnResSite(16).double()
    site.init_weights()
    sources = [torch.randn(2, 5, 16, dtype=torch.float64) * (i + 1) for i in range(4)]
    out = site(sources)
    ref = torch.stack(sources).mean(0)
    assert (out - ref).abs().max() < TOL


def test_attn_res_matches_loop_reference():
    torch.manual_seed(1)
    dim, eps = 8, 1e-6
    site = AttnResSite(dim, eps).double()
    with torch.no_grad():
        site.query.copy_(torch.randn(dim))
        site.gain.copy_(torch.rand(dim) + 0.5)
    sources = [torch.randn(3, dim, dtype=torch.float64) for _ in range(3)]
    out = site(sources)
    w = (site.gain * site.query).detach()
    for t in range(3):
        scores = []
        for v in sources:
            key = v[t] / torch.sqrt((v[t] ** 2).mean() + eps)
            scores.append(float(key @ w))
        p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
        ref = sum(pi * v[t] for pi, v in zip(p, sources, strict=True))
        assert (out[t] - ref).abs().max() < TOL


def test_attn_res_params_stay_fp32_and_output_keeps_dtype():
    site = AttnResSite(8)
    sources = [torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(2)]
    assert site.query.dtype == torch.float32 and site.gain.dtype == torch.float32
    assert site(sources).dtype == torch.bfloat16


def test_attn_res_math_stays_fp32_under_autocast():
    torch.manual_seed(2)
    site = AttnResSite(64)
    with torch.no_grad():
        site.query.normal_()
    sources = [torch.randn(4, 64) for _ in range(3)]
    ref = site(sources)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = site(sources)
    assert torch.equal(out, ref)  # bf16 scores would differ in the third significant digit
