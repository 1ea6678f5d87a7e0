"""Generation benchmark: time to first token, decode tokens/s and memory against context length.

    python bench/generate.py --out bench/generate.json                 # H200, proxy flavor, bf16
    python bench/generate.py --tiny --device cpu --lengths 128,256     # CPU smoke run

For each context length: prefill a random prompt in --prefill-chunk chunks (TTFT = prefill time
to the first sampled token), then --decode-tokens greedy steps (tokens/s = batch x steps / time),
peak memory (CUDA allocator) and the bytes of the KDA states (constant) and MLA latent caches.
"""

import argparse
import json
import time

import torch

from titan_moe.cli_args import positive
from titan_moe.model.args import apply_overrides, get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.serve.generate import Sampling, Session

TINY = {"vocab_size": 256, "dim": 64, "n_layers": 4, "mla_layers": [2, 4], "dense_hidden": 64,
        "n_heads": 2, "head_dim": 16, "kda_gate_rank": 16, "mla_n_heads": 2, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_experts": 4, "top_k": 2, "latent_dim": 32, "expert_hidden": 32, "shared_hidden": 32}


def cache_bytes(cache: list) -> tuple[int, int]:
    kda = sum(c.recurrent.nbytes + c.conv.nbytes for c in cache if hasattr(c, "recurrent"))
    mla = sum(c.kv.nbytes for c in cache if hasattr(c, "kv"))
    return kda, mla


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="proxy")
    p.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lengths", default="1024,8192,32768,131072")
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--decode-tokens", type=positive, default=32)
    p.add_argument("--prefill-chunk", type=positive, default=8192)
    p.add_argument("--out")
    a = p.parse_args()
    args = apply_overrides(get_flavor(a.flavor), dict(TINY) if a.tiny else {})
    torch.manual_seed(0)
    with torch.device(a.device):
        model = TitanMoE(args)
        model.init_weights()
    model = model.to(getattr(torch, a.dtype)).eval()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rows = []
    for length in (int(x) for x in a.lengths.split(",")):
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prompt = torch.randint(0, args.vocab_size, (a.batch, length)).tolist()
        session = Session(model, a.batch, a.prefill_chunk)
        sync()
        began = time.perf_counter()
        session.extend(prompt)
        session.decode(1, Sampling(0))
        sync()
        ttft = time.perf_counter() - began
        began = time.perf_counter()
        session.decode(a.decode_tokens, Sampling(0))
        sync()
        decode_s = time.perf_counter() - began
        kda, mla = cache_bytes(session.cache)
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else float("nan")
        rows.append({"context": length, "ttft_s": ttft,
                     "decode_tok_s": a.batch * a.decode_tokens / decode_s,
                     "kda_state_MiB": kda / 2**20, "mla_cache_MiB": mla / 2**20,
                     "peak_GiB": peak})
        r = rows[-1]
        print(f"{length:>8}  ttft {r['ttft_s']:8.3f} s  decode {r['decode_tok_s']:8.1f} tok/s  "
              f"kda {r['kda_state_MiB']:7.2f} MiB  mla {r['mla_cache_MiB']:8.2f} MiB  "
              f"peak {peak:6.2f} GiB", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"flavor": a.flavor, "tiny": a.tiny, "dtype": a.dtype, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
