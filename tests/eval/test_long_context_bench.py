"""bench/long_context.py keeps going past a length that runs out of memory: that length is an
"oom" row of the table and the JSON, the lengths after it are measured. The step is replaced by
one that fails at 128 tokens (a real OOM needs a GPU), so this checks the bookkeeping only; the
step itself is the trainer's loss path, tested in test_chunked_loss.py."""

import json
import sys

import torch
from torch.utils.checkpoint import checkpoint

from tests.bench_scripts import load_bench
from titan_moe.model import kda as kda_module
from titan_moe.model import token_chunks


def _run(bench, monkeypatch, out, *flags: str) -> dict:
    """bench/long_context.py --tiny FLAGS --out OUT, run in this process; its JSON."""
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--tiny", *flags, "--out", str(out)])
    bench.main()
    return json.loads(out.read_text())


def test_an_oom_length_is_reported_and_the_next_length_runs(tmp_path, monkeypatch, capsys):
    bench = load_bench("long_context")
    seen = []

    def fake_step(model, loss_fn, tokens, labels, doc_ids, offload=False, phases=None):
        seen.append(tokens.shape[1])
        if tokens.shape[1] == 128:
            raise torch.OutOfMemoryError(
                "CUDA out of memory (simulated). Tried to allocate 2 GiB.\nits next line")
        return 1.0

    monkeypatch.setattr(bench, "step", fake_step)
    out = tmp_path / "lc.json"
    rows = _run(bench, monkeypatch, out, "--lengths", "64,128,192")["rows"]
    assert [(r["seq_len"], r["status"]) for r in rows] == [(64, "ok"), (128, "oom"), (192, "ok")]
    # The OOM row keeps the allocator's first line (what it tried to allocate); no other row does.
    assert [r.get("error") for r in rows] == [
        None, "CUDA out of memory (simulated). Tried to allocate 2 GiB.", None]
    assert seen == [64, 128, 192]
    table = capsys.readouterr().out
    assert "128    oom" in table and "192     ok" in table


def test_offload_step_runs_on_cpu_and_rows_carry_the_plan(tmp_path, monkeypatch):
    # A real step (no fake) with the layer inputs saved through save_on_cpu: the loss matches
    # the step without offload, and every row carries the plan's peak for its length.
    bench = load_bench("long_context")
    losses = {}
    for offload in (False, True):
        out = tmp_path / f"lc{offload}.json"
        torch.manual_seed(0)
        result = _run(bench, monkeypatch, out, "--lengths", "64,128",
                      *(["--offload"] if offload else []))
        assert result["offload"] is offload and result["ac"] == "full"
        assert result["environment"]["torch"] == torch.__version__
        rows = result["rows"]
        assert all(r["status"] == "ok" for r in rows)
        # More positions, no fewer planned bytes (at this size the gradients outweigh the
        # activations); no CUDA here: no measured peak, no ratio.
        assert 0 < rows[0]["planned_peak_gib"] <= rows[1]["planned_peak_gib"]
        assert all("planned_over_measured" not in r for r in rows)
        losses[offload] = [r["loss_per_token"] for r in rows]
    assert losses[True] == losses[False]


def _planned(bench, monkeypatch, field: str) -> list:
    """The model field `field` of every plan the bench asks bench_estimate for, as it asks."""
    planned, plan = [], bench.bench_estimate

    def recording(cfg, *args):
        planned.append(getattr(cfg.args, field))
        return plan(cfg, *args)

    monkeypatch.setattr(bench, "bench_estimate", recording)
    return planned


def _checkpointed_sizes(monkeypatch, module, dim: int) -> list[int]:
    """The size along `dim` of the first input of every checkpoint `module` runs on real
    tensors (the plan runs the layers on meta), as they run."""
    sizes = []

    def counted(fn, x, *args, **kwargs):
        if not x.is_meta:
            sizes.append(x.shape[dim])
        return checkpoint(fn, x, *args, **kwargs)

    monkeypatch.setattr(module, "checkpoint", counted)
    return sizes


def test_moe_chunk_reaches_the_model_and_the_plan(tmp_path, monkeypatch):
    # A real CPU step with the MoE layer in chunks of 48 tokens (64 and 128 are no multiples):
    # the same loss as unchunked (float32; the chunks' weight-gradient sums are ordered
    # differently, the loss itself is per token: 1e-6 relative), the plan given the chunk.
    bench = load_bench("long_context")
    planned_chunks = _planned(bench, monkeypatch, "moe_token_chunk")
    chunk_sizes = _checkpointed_sizes(monkeypatch, token_chunks, 0)
    losses = {}
    for chunk in (0, 48):
        out = tmp_path / f"lc{chunk}.json"
        torch.manual_seed(0)
        result = _run(bench, monkeypatch, out, "--lengths", "64,128", "--moe-chunk", str(chunk))
        assert result["moe_chunk"] == chunk
        losses[chunk] = [r["loss_per_token"] for r in result["rows"]]
    assert planned_chunks == [0, 0, 48, 48]
    # One MoE layer; each forward runs twice (the step's, then full AC's recompute).
    assert chunk_sizes == [48, 16] * 2 + [48, 48, 32] * 2
    for got, want in zip(losses[48], losses[0], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)


def test_seq_segment_reaches_the_model_the_plan_and_every_row(tmp_path, monkeypatch):
    # A real CPU step with layer 0's KDA mixer by segments of 64 positions and its dense FFN by
    # chunks of 64 tokens: the same loss as whole (float32: 1e-6 relative), the plan given the
    # segment, and each row records it.
    bench = load_bench("long_context")
    planned = _planned(bench, monkeypatch, "seq_segment")
    segments = _checkpointed_sizes(monkeypatch, kda_module, 1)
    chunks = _checkpointed_sizes(monkeypatch, token_chunks, 0)
    losses = {}
    for segment in (0, 64):
        out = tmp_path / f"lc{segment}.json"
        torch.manual_seed(0)
        result = _run(bench, monkeypatch, out, "--lengths", "128,192",
                      "--seq-segment", str(segment))
        assert result["seq_segment"] == segment
        assert [r["seq_segment"] for r in result["rows"]] == [segment] * 2
        losses[segment] = [r["loss_per_token"] for r in result["rows"]]
    assert planned == [0, 0, 64, 64]
    # Each forward runs twice (the step's, then full AC's recompute).
    assert segments == [64] * 4 + [64] * 6 and chunks == segments
    for got, want in zip(losses[64], losses[0], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)


def test_phase_peaks_follow_the_backward_layer_by_layer(tmp_path, monkeypatch):
    # --phase-peaks: the extra step's phases in the order the backward meets them (the loss,
    # then the layers last first, each marked once although AC reruns its forward), each layer
    # with the plan's recompute of it. No CUDA: the GiB are 0, the order is the check.
    bench = load_bench("long_context")
    out = tmp_path / "lc.json"
    phases = _run(bench, monkeypatch, out, "--lengths", "64", "--phase-peaks")["rows"][0]["phases"]
    assert [p["phase"] for p in phases] == ["forward and loss", "backward, loss",
                                            "backward, layer 1", "backward, layer 0"]
    assert all(p["plan_recompute_gib"] > 0 for p in phases[2:])


def test_the_row_peak_is_the_steps_over_every_phase(tmp_path, monkeypatch):
    # --phase-peaks resets the allocator's peak counter at every phase; the row's peak must
    # still be the largest of the length's steps (it printed the last phase's). A scripted
    # allocator stands in for CUDA's: after its n-th reset the counter reads peaks[n] GiB (1:
    # the timed step; 2-5: the phase step's forward, loss, layer 1, layer 0; 6: after the end).
    bench = load_bench("long_context")
    peaks = [9.0, 3.0, 2.0, 2.5, 7.0, 5.0, 1.0]
    resets = [0]

    def reset_peak_memory_stats():
        resets[0] += 1

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda: peaks[min(resets[0], len(peaks) - 1)] * bench.GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0.5 * bench.GIB)
    counters = bench.Memory
    monkeypatch.setattr(bench, "Memory", lambda cuda: counters(True))  # on the CPU step
    out = tmp_path / "lc.json"
    row = _run(bench, monkeypatch, out, "--lengths", "64", "--phase-peaks")["rows"][0]
    assert resets[0] == 6
    assert [p["peak_gib"] for p in row["phases"]] == peaks[2:6]
    assert row["max_memory_allocated_gib"] == 7.0
    assert row["planned_over_measured"] == row["planned_peak_gib"] / 7.0


def test_an_oom_in_the_phase_step_keeps_the_phases_up_to_the_one_that_ran_out(tmp_path,
                                                                               monkeypatch):
    # A length that runs out of memory says where: its row keeps the phases recorded so far, the
    # last the one that failed, and the allocator's message. Real CPU steps; the OOM is raised
    # once, as layer 0's backward begins in the phase step of the first length; the next length
    # then records every phase (the failed step's hooks are gone: each phase is marked once).
    bench = load_bench("long_context")
    mark, raised = bench.PhasePeaks.mark, []

    def mark_then_fail(self, phase):
        mark(self, phase)
        if phase == "backward, layer 0" and not raised:
            raised.append(phase)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench.PhasePeaks, "mark", mark_then_fail)
    out = tmp_path / "lc.json"
    rows = _run(bench, monkeypatch, out, "--lengths", "64,128", "--phase-peaks")["rows"]
    assert [r["status"] for r in rows] == ["oom", "ok"]
    assert rows[0]["error"] == "CUDA out of memory (simulated)" and "error" not in rows[1]
    order = ["forward and loss", "backward, loss", "backward, layer 1", "backward, layer 0"]
    assert [p["phase"] for p in rows[0]["phases"]] == order
    assert [p["phase"] for p in rows[1]["phases"]] == order
