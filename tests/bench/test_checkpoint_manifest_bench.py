"""bench/checkpoint_manifest.py on this host: a small file, each case timed once, one row a case
(format 1, format 2 on 1 thread and on the module's thread count) in its JSON."""

import json

from tests.bench_scripts import BENCH, load_bench
from titan_moe.train.checkpoint_verify import hash_threads


def test_each_case_is_one_row(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbours as scripts
    bench = load_bench("checkpoint_manifest")
    out = tmp_path / "checkpoint_manifest.json"
    assert bench.main(["--gib", "0.01", "--repeats", "1", "--dir", str(tmp_path),
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["threads"]) for r in rows] == [
        ("format 1", 1), ("format 2 x1", 1), (f"format 2 x{hash_threads()}", hash_threads())]
    assert all(r["bytes"] == int(0.01 * (1 << 30)) and r["seconds"] > 0 for r in rows)
