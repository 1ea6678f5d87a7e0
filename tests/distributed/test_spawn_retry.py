"""spawn_layouts retries a run once when a rank dies by a signal (gloo's rare native abort on the
CPU CI host), never when a rank raises, and fails on a second signal. mp.spawn is replaced by
a stand-in that fails as told, so no process starts."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed import harness


def _spawner(failures: list[Exception | None], out: str):
    calls = []

    def spawn(fn, args, nprocs, join):
        calls.append(args[1])  # the rendezvous port
        failure = failures[len(calls) - 1]
        if failure is not None:
            raise failure
        torch.save({"rank0": "results"}, out)

    return spawn, calls


def _killed() -> mp.ProcessExitedException:
    return mp.ProcessExitedException("process 1 terminated with signal SIGABRT", 1, 4242, -6,
                                     "SIGABRT")


def test_a_rank_killed_by_a_signal_is_retried_once(tmp_path, monkeypatch):
    out = str(tmp_path / "results.pt")
    spawn, calls = _spawner([_killed(), None], out)
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    with pytest.warns(UserWarning, match="rank 1 died by SIGABRT; retrying once"):
        assert harness.spawn_layouts(2, [], out) == {"rank0": "results"}
    assert len(calls) == 2


def test_a_second_signal_fails(tmp_path, monkeypatch):
    out = str(tmp_path / "results.pt")
    spawn, calls = _spawner([_killed(), _killed()], out)
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    with pytest.warns(UserWarning), pytest.raises(mp.ProcessExitedException):
        harness.spawn_layouts(2, [], out)
    assert len(calls) == 2


@pytest.mark.parametrize("failure", [
    mp.ProcessRaisedException("AssertionError: losses differ", 0, 4242),
    mp.ProcessExitedException("process 0 terminated with exit code 1", 0, 4242, 1),
])
def test_a_rank_that_raises_or_exits_is_not_retried(tmp_path, monkeypatch, failure):
    out = str(tmp_path / "results.pt")
    spawn, calls = _spawner([failure, None], out)
    monkeypatch.setattr(harness.mp, "spawn", spawn)
    with pytest.raises(type(failure)):
        harness.spawn_layouts(2, [], out)
    assert len(calls) == 1
