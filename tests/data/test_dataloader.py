"""The torchtitan dataloader: packing through the loader, exact resume, rank sharding, errors."""

import pickle

import pytest
import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.config import JobConfig

from titan_moe.data import dataloader as titan_dataloader
from titan_moe.data.dataloader import (
    PackedTextDataset,
    build_dataloader,
    build_validation_dataloader,
)
from titan_moe.data.pystdlib import prepare_pystdlib

SEQ_LEN = 16
BATCH = 2
LENGTHS = [5, 23, 1, 9, 40, 3, 12, 7, 0, 18, 31]  # content tokens per document


@pytest.fixture
def corpus(tmp_path, jsonl, make_doc):
    """Two jsonl files and a .txt file, in sorted order: docs 0-4, 5-9, 10."""
    texts = [make_doc(i, n) for i, n in enumerate(LENGTHS)]
    jsonl(tmp_path / "corpus" / "a.jsonl", texts[:5])
    jsonl(tmp_path / "corpus" / "b.jsonl", texts[5:10])
    (tmp_path / "corpus" / "c.txt").write_text(texts[10])
    return tmp_path / "corpus"


def _loader(corpus, tokenizer, rank=0, world=1, infinite=True, shuffle=0, **kwargs):
    files = sorted(corpus.iterdir())
    dataset = PackedTextDataset(
        files, tokenizer, SEQ_LEN, rank, world, infinite, shuffle_windows=shuffle
    )
    return ParallelAwareDataloader(
        dataset, dp_rank=rank, dp_world_size=world, batch_size=BATCH, **kwargs
    )


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _flatten(batches):
    """Per-sample (input, labels, doc_ids) lists of a list of batches."""
    samples = []
    for inputs, labels in batches:
        for b in range(labels.shape[0]):
            samples.append(
                (inputs["input"][b].tolist(), labels[b].tolist(), inputs["doc_ids"][b].tolist())
            )
    return samples


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for (in_a, lab_a), (in_b, lab_b) in zip(a, b, strict=True):
        assert in_a.keys() == in_b.keys()
        assert all(torch.equal(in_a[k], in_b[k]) for k in in_a)
        assert torch.equal(lab_a, lab_b)


def test_loader_matches_naive_packing(corpus, int_tokenizer, naive):
    docs = [int_tokenizer.encode(" ".join([str(1000 + i)] * n)) for i, n in enumerate(LENGTHS)]
    batches = list(_loader(corpus, int_tokenizer, infinite=False))
    inputs, labels = batches[0]
    assert inputs["input"].shape == (BATCH, SEQ_LEN) and inputs["input"].dtype == torch.int64
    assert inputs["doc_ids"].shape == (BATCH, SEQ_LEN) and inputs["doc_ids"].dtype == torch.int32
    assert labels.shape == (BATCH, SEQ_LEN) and labels.dtype == torch.int64
    assert _flatten(batches) == naive(docs, SEQ_LEN, pad_tail=True)


def test_finite_loader_repeats_the_same_pass(corpus, int_tokenizer):
    loader = _loader(corpus, int_tokenizer, infinite=False)
    _assert_same_batches(list(loader), list(loader))


def test_infinite_loader_loops_over_epochs(corpus, int_tokenizer, naive):
    docs = [int_tokenizer.encode(" ".join([str(1000 + i)] * n)) for i, n in enumerate(LENGTHS)]
    n_samples = 3 * sum(map(len, docs)) // (SEQ_LEN + 1)
    batches = _take(iter(_loader(corpus, int_tokenizer)), n_samples // BATCH)
    assert _flatten(batches) == naive(docs * 3, SEQ_LEN, pad_tail=False)[: len(batches) * BATCH]


# (stop, rank, world, workers); worker processes are slow to start, so they get one case.
RESUME_CASES = [
    *((stop, 0, 1, 0) for stop in (1, 3, 5, 8)),
    *((stop, 1, 2, 0) for stop in (1, 4)),
    (3, 0, 1, 2),
]


@pytest.mark.parametrize("stop,rank,world,workers", RESUME_CASES)
def test_resume_reproduces_uninterrupted_batches(corpus, int_tokenizer, stop, rank, world, workers):
    shard = {"rank": rank, "world": world, "num_workers": workers}
    total = stop + 6  # an epoch is 5 batches on one shard: resumes land in or across a wrap
    reference = _take(iter(_loader(corpus, int_tokenizer, **shard)), total)

    first = _loader(corpus, int_tokenizer, **shard)
    head = _take(iter(first), stop)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = _loader(corpus, int_tokenizer, **shard)
    resumed.load_state_dict(state)
    tail = _take(iter(resumed), total - stop)
    _assert_same_batches(head + tail, reference)


@pytest.mark.parametrize("stop", [1, 4])
def test_shuffled_resume_reproduces_uninterrupted_batches(corpus, int_tokenizer, stop):
    reference = _take(iter(_loader(corpus, int_tokenizer, shuffle=4)), stop + 6)
    first = _loader(corpus, int_tokenizer, shuffle=4)
    head = _take(iter(first), stop)
    resumed = _loader(corpus, int_tokenizer, shuffle=4)
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    _assert_same_batches(head + _take(iter(resumed), 6), reference)


def test_shuffle_reorders_the_same_windows(corpus, int_tokenizer):
    plain = _flatten(_take(iter(_loader(corpus, int_tokenizer)), 12))
    shuffled = _flatten(_take(iter(_loader(corpus, int_tokenizer, shuffle=4)), 10))
    assert shuffled != plain[: len(shuffled)]
    assert all(sample in plain for sample in shuffled)


def test_resume_finite_loader_mid_pass(corpus, int_tokenizer):
    reference = list(_loader(corpus, int_tokenizer, infinite=False))
    first = _loader(corpus, int_tokenizer, infinite=False)
    head = _take(iter(first), 2)
    resumed = _loader(corpus, int_tokenizer, infinite=False)
    resumed.load_state_dict(first.state_dict())
    _assert_same_batches(head + list(resumed), reference)


def _content_docs(batches) -> set[int]:
    """Documents (content token 1000 + i) visible in a rank's inputs and labels."""
    seen = set()
    for inputs, labels in batches:
        for t in (inputs["input"], labels):
            seen.update(v - 1000 for v in t.flatten().tolist() if v >= 1000)
    return seen


def _shard_reference(tokenizer, naive, shard, n_shards):
    docs = [
        tokenizer.encode(" ".join([str(1000 + i)] * LENGTHS[i]))
        for i in range(shard, len(LENGTHS), n_shards)
    ]
    return naive(docs, SEQ_LEN, pad_tail=True)


def test_ranks_read_disjoint_documents_covering_the_corpus(corpus, int_tokenizer, naive):
    non_empty = {i for i, n in enumerate(LENGTHS) if n > 0}
    seen = []
    for rank in range(2):
        batches = list(_loader(corpus, int_tokenizer, rank=rank, world=2, infinite=False))
        assert _flatten(batches) == _shard_reference(int_tokenizer, naive, rank, 2)
        seen.append(_content_docs(batches))
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == non_empty


def test_worker_processes_shard_the_rank(corpus, int_tokenizer, naive):
    # rank 1 of 2 with 2 workers: shards 2 and 3 of 4 (documents 2, 6, 10 and 3, 7)
    loader = _loader(corpus, int_tokenizer, rank=1, world=2, infinite=False, num_workers=2)
    expected = [s for shard in (2, 3) for s in _shard_reference(int_tokenizer, naive, shard, 4)]
    assert sorted(_flatten(list(loader))) == sorted(expected)


def _job_config(**training) -> JobConfig:
    config = JobConfig()
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = BATCH
    for key, value in training.items():
        setattr(config.training, key, value)
    config.validation.seq_len = SEQ_LEN
    config.validation.local_batch_size = BATCH
    return config


def test_missing_dataset_path_names_the_config_field(tmp_path, int_tokenizer):
    missing = _job_config(dataset_path=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"training\.dataset_path"):
        build_dataloader(1, 0, int_tokenizer, missing)
    unknown = _job_config(dataset="c4_test", dataset_path=None)
    with pytest.raises(FileNotFoundError, match=r"training\.dataset_path"):
        build_dataloader(1, 0, int_tokenizer, unknown)
    with pytest.raises(FileNotFoundError, match=r"validation\.dataset_path"):
        build_validation_dataloader(1, 0, int_tokenizer, unknown)


def test_builders_read_train_and_val_splits(tmp_path, int_tokenizer, jsonl, make_doc):
    jsonl(tmp_path / "ds" / "train" / "0.jsonl", [make_doc(i, 20) for i in range(4)])
    jsonl(tmp_path / "ds" / "val" / "0.jsonl", [make_doc(50 + i, 20) for i in range(2)])
    config = _job_config(dataset_path=str(tmp_path / "ds"))
    config.validation.dataset_path = str(tmp_path / "ds")
    train = build_dataloader(1, 0, int_tokenizer, config)
    assert isinstance(train, ParallelAwareDataloader)
    assert _content_docs(_take(iter(train), 4)) == {0, 1, 2, 3}
    assert _content_docs(list(build_validation_dataloader(1, 0, int_tokenizer, config))) == {50, 51}


def test_named_pystdlib_dataset_is_prepared_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setattr(titan_dataloader, "DATA_ROOT", tmp_path)
    monkeypatch.setitem(
        titan_dataloader.LOCAL_DATASETS, "pystdlib", lambda p: prepare_pystdlib(p, 200_000)
    )
    config = _job_config(dataset="pystdlib", dataset_path=None)
    tokenizer = _ByteTokenizer()
    inputs, labels = next(iter(build_dataloader(1, 0, tokenizer, config)))
    assert (tmp_path / "pystdlib" / "manifest.json").is_file()
    assert inputs["input"].shape == (BATCH, SEQ_LEN) and inputs["input"][0, 0] == 1
    kept = labels[:, :-1] != -100
    assert torch.equal(labels[:, :-1][kept], inputs["input"][:, 1:][kept])


class _ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0-2 are pad/bos/eos), enough to pack real source text."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [1] * add_bos + [b + 3 for b in text.encode("utf-8")] + [2] * add_eos


def test_min_doc_tokens_keeps_only_long_documents(corpus, int_tokenizer, naive):
    docs = [int_tokenizer.encode(" ".join([str(1000 + i)] * n)) for i, n in enumerate(LENGTHS)]
    threshold = sorted(len(d) for d in docs)[len(docs) // 2]
    files = sorted(corpus.iterdir())
    dataset = PackedTextDataset(
        files, int_tokenizer, SEQ_LEN, infinite=False, min_doc_tokens=threshold
    )
    loader = ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=BATCH)
    long_docs = [d for d in docs if len(d) >= threshold]
    assert 0 < len(long_docs) < len(docs)
    assert _flatten(list(loader)) == naive(long_docs, SEQ_LEN, pad_tail=True)


def test_min_doc_tokens_longer_than_every_document_is_an_error(corpus, int_tokenizer):
    files = sorted(corpus.iterdir())
    dataset = PackedTextDataset(files, int_tokenizer, SEQ_LEN, min_doc_tokens=10**9)
    with pytest.raises(ValueError, match=r"training\.min_doc_tokens = 1000000000"):
        next(iter(dataset))
