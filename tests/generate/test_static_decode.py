"""The static-cache decode (titan_moe/serve/static_decode.py) against the full-sequence forward.

Reference: the model's training forward (chunked KDA op over the whole sequence, SDPA over
expanded MLA keys, no cache) on each row alone, as in test_decode_matches_forward.py. The static
path differs from it in the order of floating-point operations only (prefill chunk boundaries,
absorbed MLA over a preallocated, masked buffer), so the tolerance is the same: 1e-4 of the
largest value, float32 on CPU. Compiled steps (aot_eager: the traced graph run op by op;
inductor: generated kernels) are held to the same tolerance and must compile exactly once.
"""

import gc
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import titan_moe.model.mla as mla_module
from tests.metrics import rel_max
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.kda import StaticKDAState
from titan_moe.model.mla import GatedMLA, StaticMLACache
from titan_moe.ops.key_segment_attention import key_segment_attention
from titan_moe.serve.generate import Generator, Sampling, Session
from titan_moe.serve.static_decode import StaticGenerator, StaticSession, cache_bytes

RTOL = 1e-4


def _check_against_full_forward(model, session, prompts, done) -> None:
    """Every decoded token's log-prob and each row's last logits equal the full forward's."""
    assert all(len(c.tokens) > 0 for c in done)
    for b, (prompt, completion) in enumerate(zip(prompts, done, strict=True)):
        row = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(row)[0].float(), -1)
        n = len(prompt)
        want = logp[n - 1 : n - 1 + len(completion.tokens)].gather(
            1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert rel_max(torch.tensor(completion.logprobs), want) < RTOL, b
        assert rel_max(torch.log_softmax(session.last_logits[b], -1), logp[-1]) < RTOL, b


def _prompts(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("lengths", [(5, 64, 99), (130, 130)], ids=["ragged", "dense"])
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_static_decode_past_300_tokens_equals_full_forward(model, lengths, backend):
    """Prefill in 64-token chunks (ragged rows: the masked MLA prefill; equal rows: the
    lower-right causal one), then 300 sampled decode steps on the static cache; the compiled
    step is traced once (no graph break: fullgraph) and never recompiled."""
    torch._dynamo.reset()
    prompts = _prompts(model, lengths, seed=len(lengths))
    counter = CompileCounterWithBackend(backend) if backend else None
    steps = 300
    session = StaticSession(model, len(prompts), max(lengths) + steps + 3, prefill_chunk=64,
                            compile=backend is not None, backend=counter)
    session.extend(prompts)
    done = session.decode(steps, Sampling(temperature=1.0),
                          generator=torch.Generator().manual_seed(0))
    assert [len(c.tokens) for c in done] == [steps] * len(prompts)
    _check_against_full_forward(model, session, prompts, done)
    if counter is not None:
        assert counter.frame_count == 1
        assert counter.op_count > 0


def test_dense_prefill_by_key_segments_equals_full_forward(model, monkeypatch):
    """Rows without padding prefill in the up-projected form by key segments: with segments of
    24 slots, 64-token chunks over 200-token prompts attend over up to 6 earlier segments and
    their own slots; the last logits and 20 decoded log-probs stay within RTOL of the full
    forward, and every MLA layer took that path for every chunk."""
    calls = []

    def counted(*args):
        calls.append(args[7])  # the key segment
        return key_segment_attention(*args)

    monkeypatch.setattr(mla_module, "key_segment_attention", counted)
    monkeypatch.setattr(GatedMLA, "prefill_key_segment", 24)
    prompts = _prompts(model, (200, 200), seed=11)
    session = StaticSession(model, 2, 230, prefill_chunk=64, compile=False)
    session.extend(prompts)
    done = session.decode(20, Sampling(temperature=1.0),
                          generator=torch.Generator().manual_seed(4))
    _check_against_full_forward(model, session, prompts, done)
    chunks, mla_layers = 4, len(model.args.mla_layers)
    assert calls == [24] * (chunks * mla_layers)

def test_stops_and_inactive_rows_match_the_dynamic_session(model):
    """Stop tokens, an inactive row and a second turn: the same tokens, log-probs and stop flags
    as the dynamic-cache Session (itself checked against the full forward in
    test_decode_matches_forward.py), last logits within RTOL."""
    prompts = _prompts(model, (7, 70, 33), seed=5)
    observations = [[9, 10, 11], [12], []]
    results = []
    for make in (lambda: Session(model, 3, prefill_chunk=64),
                 lambda: StaticSession(model, 3, 160, prefill_chunk=64, compile=False)):
        session = make()
        session.extend(prompts)
        first = session.decode(12, Sampling(temperature=0), stop_tokens=[3, 17, 40],
                               active=[True, True, False])
        session.extend(observations)
        second = session.decode(6, Sampling(temperature=1.0), stop_tokens=[5],
                                generator=torch.Generator().manual_seed(1))
        results.append((first, second, session.last_logits))
    (dyn1, dyn2, dyn_last), (st1, st2, st_last) = results
    for a, b in zip(dyn1 + dyn2, st1 + st2, strict=True):
        assert a.tokens == b.tokens and a.stopped == b.stopped
        if a.logprobs:
            assert rel_max(torch.tensor(b.logprobs), torch.tensor(a.logprobs)) < RTOL
    assert st1[2].tokens == []  # the inactive row
    assert rel_max(st_last, dyn_last) < RTOL


@pytest.mark.slow
@scalar_cpp()  # one compile, no graph break, results against eager
def test_inductor_step_compiles_once_and_equals_full_forward(model):
    """The inductor-compiled step (the GPU's, less CUDA graphs): one compile over 40 steps of
    2 ragged rows, no graph break, outputs within RTOL of the full forward. Two rows, as in
    test_sessions_of_every_max_len_share_one_compile: the same step graph (the slot dim is
    dynamic), so whichever of the two compiles second loads Inductor's code from its cache."""
    torch._dynamo.reset()
    counters.clear()
    prompts = _prompts(model, (5, 99), seed=7)
    counter = CompileCounterWithBackend("inductor")
    session = StaticSession(model, 2, 160, prefill_chunk=64, backend=counter)
    session.extend(prompts)
    done = session.decode(40, Sampling(temperature=1.0), generator=torch.Generator().manual_seed(2))
    assert counter.frame_count == 1
    assert not counters["graph_break"]
    _check_against_full_forward(model, session, prompts, done)


def test_step_has_static_shapes_and_writes_caches_in_place(model):
    """Every cache tensor keeps its address and shape across steps; the MLA slot counter is a
    device tensor that counts the steps; capacity is checked on the host."""
    session = StaticSession(model, 2, 70, prefill_chunk=64, compile=False)
    session.extend(_prompts(model, (64, 64), seed=3))
    before = [(t.data_ptr(), t.shape) for c in session.cache for t in vars(c).values()
              if isinstance(t, torch.Tensor)]
    session.decode(6, Sampling(temperature=0))
    after = [(t.data_ptr(), t.shape) for c in session.cache for t in vars(c).values()
             if isinstance(t, torch.Tensor)]
    assert before == after
    mla = [c for c in session.cache if isinstance(c, StaticMLACache)]
    kda = [c for c in session.cache if isinstance(c, StaticKDAState)]
    assert mla and kda
    for c in mla:
        assert c.pos.ndim == 0 and int(c.pos) == 70 == c.filled
        assert bool(c.valid.all())
    with pytest.raises(ValueError, match="holds 70 tokens"):
        session.decode(1, Sampling(temperature=0))


def test_cache_bytes_kda_constant_mla_linear(model):
    args = model.args
    n_mla = len(args.mla_layers)
    n_kda = args.n_layers - n_mla
    sizes = {}
    for max_len in (16, 400):
        cache = model.new_static_cache(3, max_len)
        sizes[max_len] = cache_bytes(cache)
        width = args.kv_lora_rank + args.qk_rope_head_dim
        assert sizes[max_len][1] == n_mla * 3 * max_len * width * 4
    kda_each = 3 * (args.n_heads * args.head_dim**2 + (args.kda_conv_size - 1) * 3 * args.n_heads
                    * args.head_dim) * 4
    assert sizes[16][0] == sizes[400][0] == n_kda * kda_each


def test_reset_reuses_the_compiled_step(model):
    """StaticGenerator keeps one StaticSession a batch size; the second generate with the same
    prompts resets it in place and gives the same completions as the first, with no recompile,
    and the same greedy tokens as the dynamic-cache Generator."""
    torch._dynamo.reset()
    prompts = _prompts(model, (9, 40), seed=11)
    counter = CompileCounterWithBackend("aot_eager")
    gen = StaticGenerator(model, prefill_chunk=64, max_len=80, backend=counter)
    first = gen.generate(prompts, max_new_tokens=20, sampling=Sampling(temperature=0))
    gen.generate(_prompts(model, (30, 3), seed=12), max_new_tokens=5)  # another batch between
    again = gen.generate(prompts, max_new_tokens=20, sampling=Sampling(temperature=0))
    assert gen.session(2) is gen.sessions[2] and len(gen.sessions) == 1
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert counter.frame_count == 1
    dynamic = Generator(model, prefill_chunk=64).generate(prompts, max_new_tokens=20,
                                                           sampling=Sampling(temperature=0))
    assert [c.tokens for c in first] == [c.tokens for c in dynamic]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@scalar_cpp()  # one compile, no graph break, results against eager
def test_sessions_of_every_max_len_share_one_compile(model, backend):
    """Sessions of one batch size and different max_len (new buffers each, the slot dim
    dynamic, no identity guard on them) run one compiled step: one compile in all, each
    session's greedy tokens equal to those of the eager session of its max_len (exact), and a
    dropped session's cache is freed (no guard or compiled graph keeps it)."""
    torch._dynamo.reset()
    counters.clear()
    prompts = _prompts(model, (9, 40), seed=13)
    counter = CompileCounterWithBackend(backend)
    freed = []
    for max_len in (60, 150, 97):
        tokens = {}
        for compiled in (True, False):
            session = StaticSession(model, 2, max_len, prefill_chunk=64, compile=compiled,
                                    backend=counter)
            session.extend(prompts)
            done = session.decode(16, Sampling(temperature=0))
            tokens[compiled] = [c.tokens for c in done]
            assert [c.kv.shape[1] for c in session.cache if isinstance(c, StaticMLACache)] == [
                max_len] * len(model.args.mla_layers)
            freed.append(weakref.ref(session.cache[-1].kv))
            del session
        assert tokens[True] == tokens[False], max_len
    gc.collect()
    assert all(ref() is None for ref in freed)
    assert counter.frame_count == 1
    assert not counters["graph_break"]
