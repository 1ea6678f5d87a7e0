"""Corpus reading: file discovery, the global document order, sharded reads, formats, errors."""

import sys

import pytest

from titan_moe.data.corpus import BadDocument, iter_documents, list_data_files, resolve_split


@pytest.fixture
def mixed(tmp_path, jsonl):
    root = tmp_path / "mixed"
    jsonl(root / "b" / "2.jsonl", ["b0", "b1"])
    jsonl(root / "a.jsonl", ["a0", "a1", "a2"])
    (root / "a.jsonl").write_text((root / "a.jsonl").read_text() + "\n   \n")  # blank lines
    (root / "c.txt").write_text("whole\nfile\n")
    (root / "notes.md").write_text("ignored")
    (root / ".hidden").mkdir()
    jsonl(root / ".hidden" / "x.jsonl", ["hidden"])
    return root


def test_documents_in_sorted_file_order(mixed):
    files = list_data_files(mixed)
    assert [f.relative_to(mixed).as_posix() for f in files] == ["a.jsonl", "b/2.jsonl", "c.txt"]
    docs = list(iter_documents(files))
    assert docs == list(enumerate(["a0", "a1", "a2", "b0", "b1", "whole\nfile\n"]))


@pytest.mark.parametrize("start,stride", [(0, 2), (1, 2), (2, 3), (4, 1), (5, 4), (9, 1)])
def test_strided_read_equals_slicing_the_full_stream(mixed, start, stride):
    files = list_data_files(mixed)
    full = list(iter_documents(files))
    assert list(iter_documents(files, start=start, stride=stride)) == full[start::stride]


def test_text_field_and_missing_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"content": "x", "text": "y"}\n{"text": "z"}\n')
    assert [t for _, t in iter_documents([path], "text")] == ["y", "z"]
    with pytest.raises(BadDocument, match=r"d\.jsonl:2: has no field 'content'"):
        list(iter_documents([path], "content"))


def test_parquet_row_groups(tmp_path):
    import pyarrow as pa  # a dependency of datasets (hence of torchtitan)
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(10)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(10))}), path, row_group_size=3)
    files = [path, tmp_path / "u.txt"]
    (tmp_path / "u.txt").write_text("tail")
    assert list(iter_documents(files)) == list(enumerate(texts + ["tail"]))
    strided = [(2, "row 2"), (6, "row 6"), (10, "tail")]
    assert list(iter_documents(files, start=2, stride=4)) == strided


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "t.parquet"
    path.write_bytes(b"")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        list(iter_documents([path]))


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_data_files(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .jsonl"):
        list_data_files(tmp_path / "empty")


def test_resolve_split(tmp_path):
    (tmp_path / "prepared" / "train").mkdir(parents=True)
    assert resolve_split(tmp_path / "prepared", "train") == tmp_path / "prepared" / "train"
    assert resolve_split(tmp_path / "prepared", "val") == tmp_path / "prepared"
