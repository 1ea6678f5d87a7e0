"""Packing against the naive concatenate-then-slice reference (exact integer equality)."""

import random

import torch

from titan_moe.data.packing import IGNORE_INDEX, DocumentPacker, window_sample


def _pack(docs: list[list[int]], seq_len: int, pad_id: int | None) -> list[tuple]:
    packer = DocumentPacker(seq_len + 1)
    samples = []
    for doc in docs:
        packer.add(doc)
        while packer.ready():
            samples.append(window_sample(*packer.pop()))
    if pad_id is not None and len(packer):
        samples.append(window_sample(*packer.pop_padded(pad_id)))
    return samples


def _random_docs(rng: random.Random, n: int, max_len: int) -> list[list[int]]:
    return [
        [1] + [rng.randrange(3, 50) for _ in range(rng.randrange(0, max_len))] + [2]
        for _ in range(n)
    ]


def _assert_matches(samples: list[tuple], reference: list[tuple]) -> None:
    assert len(samples) == len(reference)
    for got, want in zip(samples, reference, strict=True):
        (inputs, labels, doc_ids), (ref_in, ref_lab, ref_ids) = got, want
        assert inputs.dtype == torch.int64 and labels.dtype == torch.int64
        assert doc_ids.dtype == torch.int32
        assert inputs.tolist() == ref_in
        assert labels.tolist() == ref_lab
        assert doc_ids.tolist() == ref_ids


def test_window_sample_hand_example():
    # window: [bos a eos | bos b c | bos], seq_len 6
    tokens = torch.tensor([1, 10, 2, 1, 11, 12, 1])
    starts = torch.tensor([True, False, False, True, False, False, True])
    inputs, labels, doc_ids = window_sample(tokens, starts, torch.ones(7, dtype=torch.bool))
    assert inputs.tolist() == [1, 10, 2, 1, 11, 12]
    assert labels.tolist() == [10, 2, IGNORE_INDEX, 11, 12, IGNORE_INDEX]
    assert doc_ids.tolist() == [0, 0, 0, 1, 1, 1]


def test_packing_matches_naive_reference(naive):
    rng = random.Random(0)
    for seq_len in (1, 5, 16, 33):
        docs = _random_docs(rng, 40, 25)
        _assert_matches(_pack(docs, seq_len, None), naive(docs, seq_len, pad_tail=False))


def test_padded_tail_matches_naive_reference(naive):
    rng = random.Random(1)
    for n_docs in (3, 7, 12):
        docs = _random_docs(rng, n_docs, 9)
        _assert_matches(_pack(docs, 16, pad_id=0), naive(docs, 16, pad_tail=True))
    docs = [[1, 5, 6, 2], [1, 7, 2], [1] + [8] * 20 + [2]]  # 29 tokens: one window + 12 left
    inputs, labels, doc_ids = _pack(docs, 16, pad_id=0)[-1]
    assert inputs.tolist() == [8] * 11 + [2] + [0] * 4
    assert labels.tolist() == [8] * 10 + [2] + [IGNORE_INDEX] * 5
    assert doc_ids.tolist() == [0] * 12 + [1] * 4


def test_document_longer_than_many_windows(naive):
    docs = [[1] + list(range(3, 1000)) + [2], [1, 5, 2], [1] + [7] * 300 + [2]]
    _assert_matches(_pack(docs, 31, None), naive(docs, 31, pad_tail=False))


def test_state_round_trip_continues_the_stream():
    rng = random.Random(2)
    docs = _random_docs(rng, 30, 20)
    full = _pack(docs, 8, None)
    packer = DocumentPacker(9)
    emitted = []
    for i, doc in enumerate(docs):
        packer.add(doc)
        while packer.ready():
            emitted.append(window_sample(*packer.pop()))
        if i == 11:
            state = packer.state_dict()
            packer = DocumentPacker(9)
            packer.load_state_dict(state)
    assert len(emitted) == len(full)
    for got, want in zip(emitted, full, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
