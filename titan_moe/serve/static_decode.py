"""Decoding on preallocated caches with a compiled, CUDA-graphed decode step.

`StaticSession` is a `Session` (serve/generate.py) whose cache is `model.new_static_cache(batch,
max_len)`: KDA states written in place (`StaticKDAState`) and MLA latent caches preallocated to
max_len slots with their slot counter `pos` a device tensor (`StaticMLACache`). Prefill is the
Session's: chunks of `prefill_chunk` tokens through the KDA chunk op and MLA over the filled
prefix (eager; it may sync with the host between chunks). Decoding runs `decode_step`:

    decode_step(token [B] int64, running [B] bool) -> logits [B, V] fp32

one token a row, every row: a row that is not running feeds a padding token (a no-op on its
state). Inside it the shapes are the same every step (the MLA attends over all max_len slots,
the unwritten ones masked) and nothing reads a host value, so `torch.compile(fullgraph=True,
dynamic=False)` traces it once and, with mode="reduce-overhead" (CUDA only), replays it as one
CUDA graph. The host's only per-step bookkeeping is a Python counter (`filled`, the slots
written, for prefill and the capacity check), never passed to the graph.

One compiled step serves every session of a batch size, whatever its max_len: the step is one
module-level function that takes the model and the cache as arguments (no closure per session),
the MLA buffers' slot dim is marked dynamic (`maybe_mark_dynamic`: one graph for every cache
length; everything else stays static) and the cache tensors are marked static addresses
without an identity guard (`mark_static_address(guard=False)`): the graph reads and writes them
where they are, a CUDA graph is captured per session (cudagraph trees re-record when a static
input moves or the slot count changes), and a new session with new buffers reuses the compiled
code. Decode at max_len S still reads S slots: the shapes are symbolic, not padded to a maximum.
On CUDA the MLA attention is the Triton op of ops/mla_decode.py, whose split count depends on
the batch and heads only and whose split length, an expression of S with no guard on it, is a
runtime kernel argument, so every S of a batch size shares the graph ("maybe": a guard on S,
should one appear, recompiles instead of raising).

`decode` samples on the device (no per-step sync) and collects tokens, log-probs and stops in
device buffers, reading them back once at the end (and `running.any()` every `check_every`
steps, to end early when every row has stopped).
"""

import functools
from collections.abc import Callable, Sequence

import torch

from titan_moe.data.tokenizer import TitanTokenizer
from titan_moe.model.kda import StaticKDAState
from titan_moe.model.mla import StaticMLACache
from titan_moe.model.model import TitanMoE
from titan_moe.serve.generate import Completion, Generator, Sampling, Session, sample

Cache = Sequence[StaticKDAState | StaticMLACache]
DecodeStep = Callable[[TitanMoE, Cache, torch.Tensor, torch.Tensor], torch.Tensor]


def cache_tensors(cache: Cache) -> list[torch.Tensor]:
    """Every buffer of a static cache (the ones a decode step reads and writes in place)."""
    out = []
    for c in cache:
        if isinstance(c, StaticMLACache):
            out += [c.kv, c.valid, c.pos]
        else:
            out += [c.recurrent, c.conv]
    return out


def cache_bytes(cache: Sequence) -> tuple[int, int]:
    """(KDA state bytes: recurrent states and conv taps, MLA latent-cache bytes: kv slots) of a
    dynamic or static cache."""
    kda = sum(c.recurrent.nbytes + c.conv.nbytes for c in cache if hasattr(c, "recurrent"))
    mla = sum(c.kv.nbytes for c in cache if hasattr(c, "kv"))
    return kda, mla


def mark_for_compile(cache: Cache) -> None:
    """Marks a static cache for the compiled step: every buffer a static address the graph
    reads and writes in place, with no guard on its identity (another session's buffers reuse
    the graph), and the MLA buffers' slot dim dynamic (another max_len reuses it too)."""
    for t in cache_tensors(cache):
        torch._dynamo.mark_static_address(t, guard=False)
    for c in cache:
        if isinstance(c, StaticMLACache):
            torch._dynamo.maybe_mark_dynamic(c.kv, 1)
            torch._dynamo.maybe_mark_dynamic(c.valid, 1)


def decode_step(model: TitanMoE, cache: Cache, token: torch.Tensor, running: torch.Tensor
                ) -> torch.Tensor:
    """The eager decode step over `cache` (see the module docstring)."""
    return model(token[:, None], cache=cache, valid=running[:, None])[:, -1].float()


def resolve_mode(mode: str | None, device: torch.device) -> str | None:
    """"auto": "reduce-overhead" (CUDA graphs) on CUDA, the default mode elsewhere."""
    if mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else None
    return mode


@functools.cache
def compile_decode_step(mode: str | None = None, backend="inductor") -> DecodeStep:
    """decode_step under torch.compile with no graph break allowed and static shapes but the
    ones mark_for_compile marks dynamic. One callable per (mode, backend), shared by the
    sessions, so their steps share one compile whatever Dynamo's backend comparison does.
    `mode` only applies to the inductor backend."""
    if backend == "inductor":
        return torch.compile(decode_step, fullgraph=True, dynamic=False, mode=mode)
    return torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backend)


class StaticSession(Session):
    """A Session on a static cache of max_len slots a row (prompt, observations and generated
    tokens together, padding included) with a compiled decode step.

    compile: False runs the same step eagerly (the reference the tests compare against);
    mode: "auto" (CUDA graphs on CUDA), None or any torch.compile mode; backend: a torch.compile
    backend (tests count compiles with torch._dynamo.testing.CompileCounterWithBackend).
    """

    def __init__(
        self,
        model: TitanMoE,
        batch: int,
        max_len: int,
        prefill_chunk: int = 1024,
        compile: bool = True,
        mode: str | None = "auto",
        backend="inductor",
    ) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.max_len = max_len
        self.filled = 0  # slots written (the same for every row), host side
        super().__init__(model, batch, prefill_chunk)
        mark_for_compile(self.cache)
        self.mode = resolve_mode(mode, self.device) if compile else None
        self.step = compile_decode_step(self.mode, backend) if compile else decode_step

    def reset(self) -> None:
        """Empty the session in place (nothing seen yet) for the next batch of prompts: the
        same buffers, so the compiled step is reused and so is its captured CUDA graph."""
        for t in cache_tensors(self.cache):
            t.zero_()
        self._advance(-self.filled)
        self.last_logits = None
        self.lengths = [0] * self.batch

    def _new_cache(self) -> list[StaticKDAState | StaticMLACache]:
        return self.model.new_static_cache(self.batch, self.max_len)

    def _reserve(self, n: int) -> None:
        if self.filled + n > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} tokens a row; "
                             f"{self.filled} written, {n} more asked")

    def _advance(self, n: int) -> None:
        self.filled += n
        for c in self.cache:
            if isinstance(c, StaticMLACache):
                c.filled += n

    def _forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self._reserve(tokens.shape[1])
        logits = self.model(tokens, cache=self.cache, valid=valid)
        self._advance(tokens.shape[1])
        return logits

    @torch.no_grad()
    def step_logits(self, token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """One decode step: logits [B, V] fp32 (a CUDA-graph output under reduce-overhead,
        valid until the next step), the cache advanced one slot."""
        self._reserve(1)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.step(self.model, self.cache, token, running)
        self._advance(1)
        return logits

    @torch.no_grad()
    def decode(
        self,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        active: Sequence[bool] | None = None,
        generator: torch.Generator | None = None,
        check_every: int = 32,
    ) -> list[Completion]:
        """Session.decode's contract, without a host sync per step."""
        if self.last_logits is None:
            raise RuntimeError("extend the session with a prompt before decoding")
        self._reserve(max_new_tokens)
        sampling = sampling or Sampling()
        b, dev = self.batch, self.device
        running = torch.tensor([True] * b if active is None else list(active), device=dev)
        stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=dev)
        tokens = torch.zeros(b, max_new_tokens, dtype=torch.long, device=dev)
        logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=dev)
        emitted = torch.zeros(b, max_new_tokens, dtype=torch.bool, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        last = self.last_logits
        for i in range(max_new_tokens):
            if i and i % check_every == 0 and not bool(running.any()):
                break
            token = sample(last, sampling, generator)
            tokens[:, i] = token
            logprobs[:, i] = torch.log_softmax(last, -1).gather(1, token[:, None])[:, 0]
            emitted[:, i] = running
            logits = self.step_logits(token, running)
            last = torch.where(running[:, None], logits, last)
            hit = torch.isin(token, stops) & running
            stopped |= hit
            running = running & ~hit
        self.last_logits = last
        tokens, logprobs, emitted, stopped = (x.cpu() for x in (tokens, logprobs, emitted,
                                                                 stopped))
        out = []
        for row in range(b):
            keep = emitted[row]
            done = Completion(tokens[row][keep].tolist(), logprobs[row][keep].tolist(),
                              bool(stopped[row]))
            self.lengths[row] += len(done.tokens)
            out.append(done)
        return out


class StaticGenerator(Generator):
    """A Generator whose sessions are StaticSessions of max_len tokens a row: one per batch size,
    kept and reset between uses, so its compiled step is reused (rollouts, repeated generate)."""

    def __init__(
        self,
        model: TitanMoE,
        tokenizer: TitanTokenizer | None = None,
        prefill_chunk: int = 1024,
        max_len: int = 4096,
        compile: bool = True,
        mode: str | None = "auto",
        backend="inductor",
    ) -> None:
        super().__init__(model, tokenizer, prefill_chunk)
        self.max_len = max_len
        self.options = {"compile": compile, "mode": mode, "backend": backend}
        self.sessions: dict[int, StaticSession] = {}

    def session(self, batch: int) -> StaticSession:
        session = self.sessions.get(batch)
        if session is None:
            session = StaticSession(self.model, batch, self.max_len, self.prefill_chunk,
                                    **self.options)
            self.sessions[batch] = session
        else:
            session.reset()
        return session
