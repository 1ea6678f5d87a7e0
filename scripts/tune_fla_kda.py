"""Autotune fla-core's KDA kernels once on this GPU and keep the configs they chose, so later
runs on the same GPU model start without minutes of autotuning (`titan_moe/ops/kda/fla_backend.py`
hands them to fla's config cache).

    python scripts/tune_fla_kda.py            # CUDA + fla-core: writes fla_configs/<GPU>/*.json

It runs, in bf16 at the proxy's heads (16 x 128), every fla variant that the model, the GPU
tests and `bench/kda.py` call: the fused gate with documents (the model), a given gate with and
without documents, with initial and final states, through our custom op and through fla's own
`chunk_kda`, forward and backward. Then it writes, for each autotuned fla kernel, the config
chosen for each autotune key in fla's config-file format (`fla/ops/utils/cache.py`).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_moe.ops.kda import chunk_kda_fla
from titan_moe.ops.kda.fla_backend import FLA_INSTALL_HINT, FLA_INSTALLED, fla_config_dir

HEADS, HEAD_DIM, G_MIN = 16, 128, -5.0


def inputs(batch: int, seq_len: int, fused: bool) -> list[torch.Tensor]:
    shape = (batch, seq_len, HEADS, HEAD_DIM)
    q = F.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
    k = F.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(shape, device="cuda").bfloat16()
    g = (3 * torch.randn(shape, device="cuda") if fused
         else G_MIN * torch.rand(shape, device="cuda")).bfloat16()
    beta = torch.rand(batch, seq_len, HEADS, device="cuda").bfloat16()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def gate_params() -> dict:
    return dict(A_log=torch.zeros(HEADS, device="cuda", requires_grad=True),
                dt_bias=torch.zeros(HEADS * HEAD_DIM, device="cuda", requires_grad=True))


def run_variants(batch: int, seq_len: int, doc_len: int, out: Path) -> None:
    """One forward + backward of every variant (the first call of each autotunes); the configs
    are written after each, so a run cut short keeps what it tuned."""
    from fla.ops.kda import chunk_kda

    doc = (torch.arange(seq_len, device="cuda") // doc_len).expand(batch, -1).contiguous()
    cu = torch.arange(0, seq_len + 1, doc_len, device="cuda")  # fla's varlen: batch 1 only
    h0 = torch.zeros(batch, HEADS, HEAD_DIM, HEAD_DIM, device="cuda")
    calls = {
        "op, fused gate, documents": lambda: chunk_kda_fla(
            *inputs(batch, seq_len, True), doc=doc, g_min=G_MIN, **gate_params())[0],
        "op, given gate, documents": lambda: chunk_kda_fla(
            *inputs(batch, seq_len, False), doc=doc, g_min=G_MIN)[0],
        "op, given gate, states": lambda: sum(x.float().sum() for x in chunk_kda_fla(
            *inputs(batch, seq_len, False), initial_state=h0.clone().requires_grad_(),
            output_final_state=True, g_min=G_MIN)),
        "fla, fused gate": lambda: chunk_kda(
            *inputs(batch, seq_len, True), safe_gate=True, lower_bound=G_MIN,
            use_gate_in_kernel=True, **gate_params())[0],
        "fla, given gate, varlen": lambda: chunk_kda(
            *inputs(batch, seq_len, False), cu_seqlens=cu, safe_gate=True,
            lower_bound=G_MIN)[0],
        "fla, given gate, states": lambda: sum(x.float().sum() for x in chunk_kda(
            *inputs(batch, seq_len, False), initial_state=h0.clone().requires_grad_(),
            output_final_state=True, safe_gate=True, lower_bound=G_MIN)),
    }
    for name, call in calls.items():
        call().float().sum().backward()
        torch.cuda.synchronize()
        print(f"tuned: {name} ({batch}, {seq_len}, {HEADS}, {HEAD_DIM})", flush=True)
        write_configs(out)


def tuned_configs() -> dict[str, dict]:
    """fla-format config files, one per autotuned kernel that has chosen a config."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    files: dict[str, dict] = {}
    tuners = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla."):
            continue
        for obj in vars(module).values():
            while obj is not None:  # @triton.heuristics and friends wrap the autotuner
                if isinstance(obj, CachedAutotuner):
                    tuners[id(obj)] = obj
                    break
                obj = getattr(obj, "fn", None)
    for tuner in tuners.values():
        entries = {}
        for key, cfg in tuner.cache.items():
            config = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps,
                      "num_stages": cfg.num_stages, "num_ctas": cfg.num_ctas,
                      "maxnreg": cfg.maxnreg}
            entries[AutotuneKey.key_hash(key)] = {"autotune_key": list(key), "config": config}
        if entries:
            # The first key tuned (the model's variant: run_variants calls it first) is the
            # default for keys never tuned, read by fla's "full" cache mode.
            files[tuner.kernel_name] = {"kernel_name": tuner.kernel_name,
                                        "triton_version": triton.__version__,
                                        "autotune_entries": entries,
                                        "default_config": next(iter(entries.values()))["config"]}
    return files


def write_configs(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for kernel, data in sorted(tuned_configs().items()):
        (out / f"{kernel}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"  {out / kernel}.json: {len(data['autotune_entries'])} keys")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder (default: titan_moe/ops/kda/fla_configs/<GPU>)")
    opts = parser.parse_args(argv)
    if not (torch.cuda.is_available() and FLA_INSTALLED):
        parser.error(f"needs CUDA and fla-core ({FLA_INSTALL_HINT})")
    out = opts.out or fla_config_dir(torch.cuda.get_device_name())
    os.environ["FLA_CACHE_MODE"] = "disabled"  # tune afresh: kept configs must not answer
    torch.manual_seed(0)
    run_variants(1, opts.seq_len, opts.doc_len, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
