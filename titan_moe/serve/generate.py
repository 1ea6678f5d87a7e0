"""Generate text from a titan_moe checkpoint: chunked prefill, then one token at a time.

    python -m titan_moe.serve.generate --checkpoint outputs/debug/checkpoint --prompt "def add(" \
        [--config configs/debug.toml] [--max-new-tokens 64] [--temperature 0.8] [--top-p 0.95] \
        [--stop "<|eos|>"] [--seed 0]

The prompt (or prompts: --prompt may repeat, each one a row of the batch) is prefilled in chunks
of --prefill-chunk tokens through the KDA chunk op with `output_final_state`; decoding then runs
the one-step KDA recurrence on a constant-size state [B,H,K,V] per layer (plus its conv taps) and
absorbed MLA over the latent cache (c_kv, k_rope). Rows are right-padded: `valid` marks each
row's real tokens and padding never enters a state. The MoE routes in eval mode, so the QB biases
are only read (no histogram is accumulated).

Python API: `Generator(model, tokenizer).generate(prompts, ...)`, or a `Session` for multi-turn
use (extend with tool output, decode again, without re-reading the history).
"""

import argparse
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titan_moe.cli_args import in_range, positive
from titan_moe.data.tokenizer import TitanTokenizer, asset_path
from titan_moe.model.args import ConfigError, TitanMoEArgs, model_args
from titan_moe.model.model import TitanMoE
from titan_moe.ops.kda import CHUNK_SIZE
from titan_moe.train.checkpoint_verify import MANIFEST, CheckpointError, verify_checkpoint


@dataclass
class Sampling:
    """temperature 0 is greedy (argmax); top_p keeps the smallest set of tokens whose mass
    reaches top_p."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] -> the nucleus renormalised: the most likely tokens whose mass first
    reaches top_p (the token that crosses it included), every other token 0."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    kept = torch.where(mass_before < top_p, sorted_probs, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, kept)
    return filtered / filtered.sum(-1, keepdim=True)


def sample(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        probs = top_p_filter(probs, sampling.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Completion:
    """One row's decoded tokens, their log-probabilities under the model (temperature 1, no
    top-p) and whether a stop token ended it (the stop token is the last one in `tokens`)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False


class Session:
    """The decode state of B rows; every token given or generated is folded into it once."""

    def __init__(self, model: TitanMoE, batch: int, prefill_chunk: int = 1024) -> None:
        if prefill_chunk <= 0 or prefill_chunk % CHUNK_SIZE:
            raise ValueError(
                f"prefill_chunk must be a positive multiple of {CHUNK_SIZE}, got {prefill_chunk}"
            )
        self.model = model
        self.batch = batch
        self.prefill_chunk = prefill_chunk
        self.cache = self._new_cache()
        self.device = model.output.weight.device
        self.last_logits: torch.Tensor | None = None  # [B, V] after each row's newest token
        self.lengths = [0] * batch

    @torch.no_grad()
    def extend(self, rows: Sequence[Sequence[int]]) -> None:
        """Feed each row its tokens (ragged; an empty row is left as it is) in prefill chunks."""
        if len(rows) != self.batch:
            raise ValueError(f"need one token list per row ({self.batch}), got {len(rows)}")
        width = max(len(r) for r in rows)
        if width == 0:
            return
        tokens = torch.zeros(self.batch, width, dtype=torch.long)
        valid = torch.zeros(self.batch, width, dtype=torch.bool)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
            valid[b, : len(row)] = True
            self.lengths[b] += len(row)
        tokens, valid = tokens.to(self.device), valid.to(self.device)
        last = self._logits_at_last_valid(tokens, valid)
        fed = valid.any(1, keepdim=True)
        self.last_logits = last if self.last_logits is None else torch.where(
            fed, last, self.last_logits)

    def _logits_at_last_valid(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n_valid = valid.sum(1)
        last = None
        for start in range(0, tokens.shape[1], self.prefill_chunk):
            end = start + self.prefill_chunk
            logits = self._forward(tokens[:, start:end], valid[:, start:end])
            index = (n_valid - 1 - start).clamp(0, logits.shape[1] - 1)
            here = logits.gather(1, index.view(-1, 1, 1).expand(-1, 1, logits.shape[-1]))[:, 0]
            in_chunk = ((n_valid - 1 >= start) & (n_valid - 1 < end)).unsqueeze(-1)
            last = here if last is None else torch.where(in_chunk, here, last)
        return last.float()

    def _new_cache(self) -> list:
        return self.model.new_cache(self.batch)

    def _forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One model call on the cache (a prefill chunk): logits [B, T, V]."""
        return self.model(tokens, cache=self.cache, valid=valid)

    @torch.no_grad()
    def decode(
        self,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        active: Sequence[bool] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        """Sample up to max_new_tokens per active row, each stopping after a stop token.

        Every sampled token (the stop token too) is fed back, so the session continues after
        it: `extend` with an observation, then `decode` again.
        """
        if self.last_logits is None:
            raise RuntimeError("extend the session with a prompt before decoding")
        sampling = sampling or Sampling()
        running = torch.tensor([True] * self.batch if active is None else list(active),
                               device=self.device)
        stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=self.device)
        out = [Completion() for _ in range(self.batch)]
        for _ in range(max_new_tokens):
            if not bool(running.any()):
                break
            token = sample(self.last_logits, sampling, generator)
            logprob = torch.log_softmax(self.last_logits, -1).gather(1, token[:, None])[:, 0]
            logits = self.model(token[:, None], cache=self.cache, valid=running[:, None])
            self.last_logits = torch.where(running[:, None], logits[:, -1].float(),
                                           self.last_logits)
            for b in running.nonzero().flatten().tolist():
                out[b].tokens.append(int(token[b]))
                out[b].logprobs.append(float(logprob[b]))
                self.lengths[b] += 1
            hit_stop = torch.isin(token, stops)
            for b in (running & hit_stop).nonzero().flatten().tolist():
                out[b].stopped = True
            running = running & ~hit_stop
        return out


class Generator:
    """A model (eval mode) and optionally its tokenizer; `generate` is prefill + decode.
    (serve/static_decode.py's StaticGenerator decodes with the compiled static-cache step.)"""

    def __init__(
        self, model: TitanMoE, tokenizer: TitanTokenizer | None = None, prefill_chunk: int = 1024
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk

    def session(self, batch: int) -> Session:
        return Session(self.model, batch, self.prefill_chunk)

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int = 64,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        """One completion per prompt (token ids, or text when a tokenizer is set). Stops default
        to the tokenizer's eos."""
        rows = [self._ids(p) for p in prompts]
        if any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token")
        if stop_tokens is None:
            stop_tokens = [self.tokenizer.eos_id] if self.tokenizer is not None else []
        session = self.session(len(rows))
        session.extend(rows)
        return session.decode(max_new_tokens, sampling, stop_tokens, generator=generator)

    def _ids(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            return self.tokenizer.encode(prompt, add_bos=True, add_eos=False)
        return list(prompt)


def model_args_from_toml(config: str | Path | None, flavor: str | None = None) -> TitanMoEArgs:
    """The model args a training TOML describes: [model] flavor plus its [titan_moe] overrides."""
    values: dict = {}
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        with open(path, "rb") as f:
            values = tomllib.load(f)
    return model_args(flavor or values.get("model", {}).get("flavor", "debug"),
                      **values.get("titan_moe", {}))


def resolve_checkpoint(path: str | Path, args: TitanMoEArgs) -> Path:
    """A DCP checkpoint folder checked against its manifest and `args`: `path` itself if it has
    .metadata, else its newest step-N below it (also below path/checkpoint, torchtitan's default
    folder) that verifies, newer ones that do not skipped with a warning. Raises CheckpointError
    for a damaged explicit folder and ModelArgsMismatch for other model args; a folder without
    a manifest (not written by the trainer) loads with a warning that it is unverified."""
    path = Path(path)
    if (path / ".metadata").is_file():
        _verify(path, args)
        return path
    steps = [p for base in (path, path / "checkpoint") if base.is_dir()
             for p in base.glob("step-*") if (p / ".metadata").is_file()]
    if not steps:
        raise FileNotFoundError(f"no complete DCP checkpoint (step-N/.metadata) under {path}")
    for step in sorted(steps, key=lambda p: int(p.name.split("-")[-1]), reverse=True):
        try:
            _verify(step, args)
            return step
        except CheckpointError as e:
            print(f"warning: skipping checkpoint {step.name}: {e}", file=sys.stderr)
    raise CheckpointError(f"no checkpoint under {path} verifies (each is named above)")


def _verify(step: Path, args: TitanMoEArgs) -> None:
    if (step / MANIFEST).is_file():
        verify_checkpoint(step, args)
    else:
        print(f"warning: {step} has no {MANIFEST}: loading it unverified", file=sys.stderr)


def load_model(
    checkpoint: str | Path | None,
    args: TitanMoEArgs,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> TitanMoE:
    """The model with a checkpoint's weights and QB biases (torchtitan DCP, model keys at the top
    level), or seeded random init when checkpoint is None. Returned in eval mode."""
    torch.manual_seed(seed)
    model = TitanMoE(args)
    model.init_weights()
    if checkpoint is not None:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(resolve_checkpoint(checkpoint, args)))
        model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DCP step folder or a folder of them")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--config", help="the training TOML (flavor and [titan_moe] overrides)")
    parser.add_argument("--flavor", help="model flavor, overriding the config's")
    parser.add_argument("--tokenizer", help="tokenizer JSON (default: the flavor's asset)")
    parser.add_argument("--max-new-tokens", type=positive, default=64)
    parser.add_argument("--temperature", type=in_range(float, 0), default=1.0)
    parser.add_argument("--top-p", type=in_range(float, 0, 1, open_low=True), default=1.0)
    parser.add_argument("--stop", action="append", default=[],
                        help="stop token (a vocabulary entry such as <|eos|>); eos by default")
    parser.add_argument("--prefill-chunk", type=positive, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    try:
        args = model_args_from_toml(opts.config, opts.flavor)
        sampling = Sampling(opts.temperature, opts.top_p)
    except ValueError as e:
        parser.error(str(e))
    tokenizer = TitanTokenizer(opts.tokenizer or asset_path(args.vocab_size))
    stops = []
    for name in opts.stop or ["<|eos|>"]:
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            parser.error(f"--stop {name!r} is not a token of {tokenizer.path}")
        stops.append(token_id)
    device = _device(opts.device)
    model = load_model(opts.checkpoint, args, device, getattr(torch, opts.dtype))
    gen = Generator(model, tokenizer, opts.prefill_chunk)
    rng = torch.Generator(device=device).manual_seed(opts.seed)
    for prompt, done in zip(opts.prompt, gen.generate(opts.prompt, opts.max_new_tokens, sampling,
                                                      stops, rng), strict=True):
        print(prompt + tokenizer.decode(done.tokens))


if __name__ == "__main__":
    main()
