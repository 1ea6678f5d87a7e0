"""Bad documents are named by file:line; with skip_bad_documents they are skipped and counted.

Reference for a skip: the loader over a corpus with bad lines yields exactly the windows of the
same corpus without them, and resuming from a saved position continues that sequence.
"""

import json

import pytest

from titan_moe.data.corpus import BadDocument, iter_documents
from titan_moe.data.dataloader import PackedTextDataset

SEQ_LEN = 8


def _lines(texts: list[str]) -> list[str]:
    return [json.dumps({"text": t}) + "\n" for t in texts]


@pytest.mark.parametrize("bad, reason", [
    (b'{"text": "1 2\n', "invalid JSON"),
    (b'{"body": "1 2"}\n', "has no field 'text'"),
    (b'{"text": 12}\n', "field 'text' is not a string"),
    (b'{"text": "\xff"}\n', "not UTF-8"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "d.jsonl"
    good = "".join(_lines(["1 2", "3 4"])).encode()
    path.write_bytes(good + b"\n" + bad + good)  # the bad document is on line 4
    with pytest.raises(BadDocument, match=rf"^{path}:4: {reason}"):
        list(iter_documents([path]))
    # Documents before the bad one are read; a shard without it never meets it.
    assert [t for _, t in iter_documents([path], start=1, stride=2)] == ["3 4", "1 2"]


def test_a_non_utf8_txt_file_is_named_with_the_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"first line\nsecond \xe9 line\n")
    with pytest.raises(BadDocument, match=rf"^{path}:2: not UTF-8"):
        list(iter_documents([path]))


def _dataset(files, tokenizer, skip: bool) -> PackedTextDataset:
    return PackedTextDataset(files, tokenizer, SEQ_LEN, infinite=False, skip_bad_documents=skip)


def _windows(dataset) -> list[list[int]]:
    return [inputs["input"].tolist() for inputs, _ in dataset]


def test_bad_documents_stop_the_loader_unless_skipped(tmp_path, int_tokenizer, make_doc):
    texts = [make_doc(i, n) for i, n in enumerate([5, 9, 3, 12, 7, 4])]
    lines = _lines(texts)
    clean, dirty = tmp_path / "clean.jsonl", tmp_path / "dirty.jsonl"
    clean.write_text("".join(lines))
    dirty.write_text("".join(lines[:2] + ["not json\n"] + lines[2:5] + ['{"id": 1}\n'] + lines[5:]))
    with pytest.raises(BadDocument, match=rf"^{dirty}:3: invalid JSON"):
        _windows(_dataset([dirty], int_tokenizer, skip=False))
    skipping = _dataset([dirty], int_tokenizer, skip=True)
    want = _windows(_dataset([clean], int_tokenizer, skip=False))
    assert _windows(skipping) == want
    assert skipping.stats() == {"data/skipped_documents": 2}


def test_a_resumed_skipping_loader_continues_the_same_windows(tmp_path, int_tokenizer, make_doc):
    lines = _lines([make_doc(i, 6) for i in range(8)])
    dirty = tmp_path / "dirty.jsonl"
    dirty.write_text("".join(lines[:3] + ["{\n"] + lines[3:]))
    straight = _windows(_dataset([dirty], int_tokenizer, skip=True))
    first = _dataset([dirty], int_tokenizer, skip=True)
    iterator = iter(first)
    head = [next(iterator)[0]["input"].tolist() for _ in range(3)]  # past the bad line
    resumed = _dataset([dirty], int_tokenizer, skip=True)
    resumed.load_state_dict(first.state_dict())
    assert head + _windows(resumed) == straight
    assert resumed.stats() == {"data/skipped_documents": 1}
