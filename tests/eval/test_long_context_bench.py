"""bench/long_context.py keeps going past a length that runs out of memory: that length is an
"oom" row of the table and the JSON, the lengths after it are measured. The step is replaced by
one that fails at 128 tokens (a real OOM needs a GPU), so this checks the bookkeeping only; the
step itself is the trainer's loss path, tested in test_chunked_loss.py."""

import json
import sys

import torch

from tests.bench_scripts import load_bench


def test_an_oom_length_is_reported_and_the_next_length_runs(tmp_path, monkeypatch, capsys):
    bench = load_bench("long_context")
    seen = []

    def fake_step(model, loss_fn, tokens, labels, doc_ids):
        seen.append(tokens.shape[1])
        if tokens.shape[1] == 128:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return 1.0

    monkeypatch.setattr(bench, "step", fake_step)
    out = tmp_path / "lc.json"
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--tiny", "--lengths", "64,128,192",
                                      "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq_len"], r["status"]) for r in rows] == [(64, "ok"), (128, "oom"), (192, "ok")]
    assert seen == [64, 128, 192]
    table = capsys.readouterr().out
    assert "128    oom" in table and "192     ok" in table
