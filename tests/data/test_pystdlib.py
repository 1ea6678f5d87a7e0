"""The stdlib corpus: deterministic, capped, held-out split, idempotent."""

import json

import pytest

from titan_moe.data.corpus import iter_documents, list_data_files
from titan_moe.data.pystdlib import prepare_pystdlib

CAP = 300_000  # bytes: a small slice of the ~30 MB stdlib keeps this test fast


def _split(folder) -> list[str]:
    return [text for _, text in iter_documents(list_data_files(folder))]


def test_prepare_is_deterministic_capped_and_split(tmp_path):
    first = prepare_pystdlib(tmp_path / "a", max_bytes=CAP, val_fraction=0.1, shard_bytes=50_000)
    second = prepare_pystdlib(tmp_path / "b", max_bytes=CAP, val_fraction=0.1, shard_bytes=50_000)
    assert first == second
    train, val = _split(tmp_path / "a" / "train"), _split(tmp_path / "a" / "val")
    assert train == _split(tmp_path / "b" / "train") and val == _split(tmp_path / "b" / "val")
    assert first["splits"]["train"]["documents"] == len(train) and len(val) >= 1
    assert first["splits"]["train"]["shards"] > 1
    total = sum(len(t.encode("utf-8")) for t in train + val)
    assert total == first["splits"]["train"]["bytes"] + first["splits"]["val"]["bytes"]
    assert CAP * 0.8 < total <= CAP
    assert not set(train) & set(val)
    assert any("def " in t for t in train)  # real Python source


def test_prepare_skips_when_done_and_force_rebuilds(tmp_path):
    out = tmp_path / "c"
    prepare_pystdlib(out, max_bytes=CAP)
    shard = out / "train" / "00000.jsonl"
    shard.write_text(json.dumps({"text": "titan-moe-sentinel-7f3a"}) + "\n")
    prepare_pystdlib(out, max_bytes=CAP)
    assert shard.read_text().startswith('{"text": "titan-moe-sentinel-7f3a"}')
    prepare_pystdlib(out, max_bytes=CAP, force=True)
    assert "titan-moe-sentinel-7f3a" not in shard.read_text()


def test_partial_folder_is_not_mistaken_for_a_prepared_one(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "junk.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="--force"):
        prepare_pystdlib(tmp_path / "d", max_bytes=CAP)
