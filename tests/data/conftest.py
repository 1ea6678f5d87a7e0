"""Shared pieces of the data tests: a transparent tokenizer and the naive packing reference."""

import json
from pathlib import Path

import pytest
from torchtitan.components.tokenizer import BaseTokenizer

PAD, BOS, EOS = 0, 1, 2
IGNORE = -100


class IntTokenizer(BaseTokenizer):
    """Text "5 7 9" is tokens [5, 7, 9]: the tests can read every packed token."""

    def __init__(self):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [BOS] * add_bos + [int(w) for w in text.split()] + [EOS] * add_eos

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def get_vocab_size(self) -> int:
        return 10**6


def doc_text(i: int, length: int) -> str:
    """Document i: ``length`` copies of the content token 1000 + i."""
    return " ".join([str(1000 + i)] * length)


def naive_windows(
    docs: list[list[int]], seq_len: int, pad_tail: bool
) -> list[tuple[list[int], list[int], list[int]]]:
    """Concatenate, then slice into seq_len + 1 windows; labels and doc ids from token owners."""
    stream, owner = [], []
    for d, tokens in enumerate(docs):
        stream += tokens
        owner += [d] * len(tokens)
    n = seq_len + 1
    n_windows = len(stream) // n
    if pad_tail and len(stream) % n:
        n_pad = n - len(stream) % n
        stream += [PAD] * n_pad
        owner += [len(docs)] * n_pad
        n_windows += 1
    samples = []
    for k in range(n_windows):
        w, o = stream[k * n : (k + 1) * n], owner[k * n : (k + 1) * n]
        labels = [
            w[t + 1] if o[t + 1] == o[t] and o[t + 1] < len(docs) else IGNORE
            for t in range(seq_len)
        ]
        samples.append((w[:seq_len], labels, [o[t] - o[0] for t in range(seq_len)]))
    return samples


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def int_tokenizer() -> IntTokenizer:
    return IntTokenizer()


@pytest.fixture
def naive():
    return naive_windows


@pytest.fixture
def make_doc():
    return doc_text


@pytest.fixture
def jsonl():
    return write_jsonl
