"""Fault suite (issue 25, point 6): each fault end to end against the real trainer, asserting that
nothing is lost beyond one checkpoint interval and that the run continues, or stops with the
message the README states ("Checkpoints", "Non-finite steps", "Data").

Every run is a process of its own calling `titan_moe.train.trainer.main` with the arguments
`python -m titan_moe.train` takes (trainer_process.py: forked from a server that imported the
trainer once, which saves ~5 s of imports a run), on the resume tests' tiny debug model (`TINY`
of tests/train/test_checkpoint_resume.py, one CPU process), saving every `INTERVAL` = 2 steps; a
restart reuses the dump folder, as a job started again would. "Nothing lost beyond one interval"
is checked as: the restart loads the newest checkpoint saved before the fault (the fault's step
less at most one interval) and no other, trains on from the step after it, and where the faulty
run trained those steps too, logs the very same losses (the checkpoint restored everything).
Checkpoints left at the end are checked against their manifests independently of
titan_moe/train/checkpoint_verify.py (`assert_verifies`).

Covered here:
- kill -9 during a save, at each of its points (after the shards, after DCP's `.metadata`, while
  the manifest is renamed into place; tests/faults/kill_during_save.py);
- a damaged and a truncated shard in the newest checkpoint: the restart falls back and trains on;
- a model config that does not match the checkpoint: the run stops naming the field and leaves the
  checkpoints as they were;
- a run of non-finite steps that stops the run: the restart resumes the checkpoint before it;
- a bad data line that stops the run: the restart with `training.skip_bad_documents` resumes the
  checkpoint before it and skips the line.
Covered elsewhere and not repeated here beyond what an end-to-end check needs:
- tests/train/test_checkpoint_verify.py: the skip message of a flipped byte, a truncated shard and
  a missing manifest (resume loading only), an explicit `checkpoint.load_step` that fails
  verification, the ModelArgsMismatch raised in-process, a temporary manifest left by a killed
  save not listed by the next save of that step;
- tests/train/test_checkpoint_resume.py: a resumed run's losses equal the uninterrupted run's;
  a step folder without DCP `.metadata` is never loaded;
- tests/train/test_step_guard.py: a single NaN step skipped and counted while the run continues
  and checkpoints; NaN on one data-parallel rank skipped by all; N in a row stop the run; a
  checkpoint of non-finite weights refused;
- tests/data/test_bad_documents.py: each kind of bad document named by file:line, skipped
  documents counted, a resumed skipping loader continuing the same windows.
"""

import hashlib
import json
import math
import re
import shutil
import signal
from pathlib import Path

import pytest

from tests.faults.trainer_process import Run, train_process
from tests.train.test_checkpoint_resume import REPO, TINY

INTERVAL = 2
MANIFEST = "manifest.json"
SHARD = "__0_0.distcp"


def train(dump: Path, steps: int, *args: str, **env: str) -> Run:
    """One single-process run of the tiny model into `dump`, saving every INTERVAL steps, in a
    process of its own (trainer_process.py); its log is kept as dump/run-<i>.log."""
    dump.mkdir(parents=True, exist_ok=True)
    log = dump / f"run-{len(list(dump.glob('run-*.log')))}.log"
    argv = [*TINY, "--checkpoint.interval", str(INTERVAL), "--training.steps", str(steps),
            "--job.dump_folder", str(dump), *args]
    env = {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin", "HOME": str(dump),
           "PYTHONPATH": str(REPO), **env}
    return train_process(argv, env, REPO, log)


def tail(run: Run) -> str:
    return run.log[-4000:]


def losses(run: Run) -> dict[int, str]:
    """The logged loss of each step the run trained, as printed."""
    return {int(step): loss for step, loss in re.findall(r"step:\s+(\d+)\s+loss:\s+(\S+)", run.log)}


def loaded(run: Run) -> list[str]:
    """The step folders the run loaded."""
    return [Path(path).name
            for path in re.findall(r"Loading the checkpoint from (\S+?)\.?$", run.log, re.M)]


def skipped(run: Run) -> list[str]:
    """The run's warnings of a checkpoint skipped on resume."""
    return re.findall(r" - WARNING - (Skipping checkpoint .*)$", run.log, re.M)


def cut_short(step_dir: Path) -> str:
    return (f"Skipping checkpoint {step_dir.name}: {step_dir} has no {MANIFEST}: its save was cut "
            "short, or it predates manifests")


def assert_verifies(step_dir: Path) -> None:
    """The step folder has a manifest (format 2) naming every other file in it, each of that
    size and the sha256 of each of its chunks (what a resume checks before it loads the step)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert manifest["format"] == 2, step_dir
    files = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
             if p.is_file() and p.name != MANIFEST}
    assert set(manifest["files"]) == files, (step_dir, sorted(manifest["files"]), sorted(files))
    for name, want in manifest["files"].items():
        data, chunk = (step_dir / name).read_bytes(), want["chunk_bytes"]
        digests = [hashlib.sha256(data[s:s + chunk]).hexdigest()
                   for s in range(0, len(data), chunk)]
        assert (len(data), digests) == (want["bytes"], want["sha256"]), (
            f"{step_dir / name} does not match its manifest")


def step_dirs(checkpoints: Path) -> list[str]:
    return sorted((p.name for p in checkpoints.iterdir()), key=lambda n: int(n.split("-")[1]))


def assert_resumed(run: Run, step: int, faulty: Run | None = None) -> None:
    """The run loaded checkpoint `step` (only that one), trained on from the step after it, and
    logged the faulty run's losses for the steps both trained (at least one)."""
    assert loaded(run) == [f"step-{step}"], tail(run)
    assert f"Training starts at step {step + 1}" in run.log, tail(run)
    assert min(losses(run)) == step + 1, tail(run)
    if faulty is not None:
        again = sorted(losses(run).keys() & losses(faulty).keys())
        assert again, (sorted(losses(run)), sorted(losses(faulty)))
        assert [losses(run)[s] for s in again] == [losses(faulty)[s] for s in again]


# --- kill -9 during a save ------------------------------------------------------------------------

KILL_STEPS = 8
# (step whose save is killed, point of the save, what its folder then holds)
KILLS = [
    (4, "shards", {SHARD}),
    (6, "metadata", {SHARD, ".metadata"}),
    (8, "manifest", {SHARD, ".metadata", f".{MANIFEST}.partial"}),
]


def test_kill_9_during_a_save_loses_at_most_one_interval(tmp_path):
    """A job of 8 steps SIGKILLed in the save of step 4, started again and SIGKILLed in the save
    of step 6, then in that of step 8, then let finish: each start warns that the killed step is
    skipped as cut short, loads the step before it (never the killed one) and retrains the same
    losses; the last start trains to the end and every checkpoint verifies (step 8 too: its
    killed save left the manifest's temporary file, which the new save of step 8 must not list)."""
    checkpoints = tmp_path / "checkpoint"
    faulty: Run | None = None
    for step, point, left in KILLS:
        run = train(tmp_path, KILL_STEPS, "--experimental.custom_import",
                    "tests.faults.kill_during_save", KILL_DURING_SAVE=f"{step}:{point}")
        assert run.returncode == -signal.SIGKILL, tail(run)
        assert f"kill_during_save: SIGKILL in the save of step-{step} at {point}" in run.log
        assert max(losses(run)) == step, tail(run)
        assert {p.name for p in (checkpoints / f"step-{step}").iterdir()} == left
        if faulty is None:
            assert not loaded(run) and "Training starts at step 1" in run.log, tail(run)
        else:
            killed = step - INTERVAL
            assert skipped(run) == [cut_short(checkpoints / f"step-{killed}")], tail(run)
            assert_resumed(run, killed - INTERVAL, faulty)
        faulty = run
    run = train(tmp_path, KILL_STEPS)
    assert run.returncode == 0, tail(run)
    assert skipped(run) == [cut_short(checkpoints / f"step-{KILL_STEPS}")], tail(run)
    assert_resumed(run, KILL_STEPS - INTERVAL, faulty)
    assert max(losses(run)) == KILL_STEPS and "Training completed" in run.log
    assert step_dirs(checkpoints) == [f"step-{s}" for s in range(2, KILL_STEPS + 1, INTERVAL)]
    for step_dir in checkpoints.iterdir():
        assert_verifies(step_dir)


# --- damaged checkpoints, another model config ----------------------------------------------------

SAVED_STEPS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Run]:
    """A finished 4-step run: checkpoints step-2 and step-4, and its log."""
    dump = tmp_path_factory.mktemp("saved")
    run = train(dump, SAVED_STEPS)
    assert run.returncode == 0, tail(run)
    assert step_dirs(dump / "checkpoint") == ["step-2", "step-4"]
    return dump / "checkpoint", run


@pytest.fixture
def checkpoints(saved, tmp_path) -> Path:
    """A copy of the saved checkpoints, inside a dump folder of its own."""
    shutil.copytree(saved[0], tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def flip_a_byte(shard: Path) -> str:
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    size = shard.stat().st_size  # less than a chunk: one chunk
    return (f"{shard} is damaged: its sha256 differs from the manifest's in chunk 0 of 1, "
            f"bytes [0, {size}) of {size}")


def truncate(shard: Path) -> str:
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    return f"{shard} has {size // 2} bytes, the manifest {size} (truncated or overwritten)"


@pytest.mark.parametrize("damage", [flip_a_byte, truncate], ids=["damaged", "truncated"])
def test_a_damaged_newest_shard_costs_one_interval_and_the_run_goes_on(saved, checkpoints,
                                                                       damage):
    """The newest checkpoint's shard damaged after the job ended: started again, the job warns
    naming the shard and why, loads the checkpoint before, retrains the same losses and saves
    the newest step again, verified."""
    newest = checkpoints / f"step-{SAVED_STEPS}"
    why = damage(newest / SHARD)
    run = train(checkpoints.parent, SAVED_STEPS)
    assert run.returncode == 0, tail(run)
    assert skipped(run) == [f"Skipping checkpoint {newest.name}: {why}"], tail(run)
    assert_resumed(run, SAVED_STEPS - INTERVAL, saved[1])
    for step_dir in checkpoints.iterdir():
        assert_verifies(step_dir)


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


def test_another_model_config_stops_naming_the_field_and_keeps_the_checkpoints(checkpoints):
    """Started again with n_layers 4 over checkpoints of n_layers 3: the run stops before any
    step with the mismatch named (checkpoint vs config value), touching no checkpoint file."""
    before = files_of(checkpoints)
    run = train(checkpoints.parent, SAVED_STEPS, "--titan_moe.n_layers", "4")
    assert run.returncode != 0
    assert (f"ModelArgsMismatch: checkpoint {checkpoints / 'step-4'} was saved for other model "
            "args: n_layers: checkpoint 3 vs config 4; train with the checkpoint's model config, "
            "or start a fresh checkpoint.folder") in run.log, tail(run)
    assert not losses(run) and not loaded(run), tail(run)
    assert files_of(checkpoints) == before
    for step_dir in checkpoints.iterdir():
        assert_verifies(step_dir)


# --- non-finite steps -----------------------------------------------------------------------------


def test_non_finite_steps_stop_the_run_and_a_restart_resumes_the_checkpoint_before(tmp_path):
    """NaN losses at steps 3 and 4 with max_consecutive_skipped_steps 2: step 3 is skipped with
    a warning, step 4 stops the run naming it; no checkpoint of step 4 exists, that of step 2
    verifies; started again (finite), the job resumes step 2 and trains to the end."""
    steps = 4
    run = train(tmp_path, steps, "--experimental.custom_import", "tests.train.nan_loss",
                "--training.max_consecutive_skipped_steps", "2", NAN_STEPS="3,4")
    assert run.returncode != 0
    nan = "non-finite loss or grad norm (loss nan on this rank, grad norm nan)"
    assert f"step 3: {nan}; optimizer step skipped (1 in a row, 1 in all)" in run.log, tail(run)
    assert (f"NonFiniteError: step 4: 2 steps in a row with a {nan}; stopping "
            "(training.max_consecutive_skipped_steps = 2)") in run.log, tail(run)
    checkpoints = tmp_path / "checkpoint"
    assert step_dirs(checkpoints) == ["step-2"]
    assert_verifies(checkpoints / "step-2")
    restart = train(tmp_path, steps)
    assert restart.returncode == 0, tail(restart)
    assert not skipped(restart), tail(restart)
    assert_resumed(restart, 2)
    assert sorted(losses(restart)) == [3, 4]
    assert all(math.isfinite(float(loss)) for loss in losses(restart).values()), tail(restart)
    assert step_dirs(checkpoints) == ["step-2", "step-4"]
    assert_verifies(checkpoints / "step-4")


# --- a bad data line ------------------------------------------------------------------------------

BAD_LINE = 7  # 58 tokens a document, 130 a step: read in step 3, after step 2's checkpoint


@pytest.fixture
def corpus(tmp_path) -> Path:
    """60 documents of 58 tokens each; line BAD_LINE is not JSON."""
    good = json.dumps({"text": " ".join(["def f(x): return x"] * 8)}) + "\n"
    path = tmp_path / "corpus.jsonl"
    path.write_text(good * (BAD_LINE - 1) + '{"text": "unterminated\n' + good * (60 - BAD_LINE))
    return path


def test_a_bad_data_line_stops_the_run_and_a_skipping_restart_resumes_the_checkpoint_before(
        tmp_path, corpus):
    """The run stops at the bad line naming it (file:line and why) after step 2's checkpoint;
    started again with skip_bad_documents, the job resumes step 2, skips the line with a warning
    naming it, and trains to the end."""
    data = ["--training.dataset_path", str(corpus), "--training.shuffle_windows", "0"]
    steps = 4
    dump = tmp_path / "dump"
    run = train(dump, steps, *data)
    assert run.returncode != 0
    assert f"BadDocument: {corpus}:{BAD_LINE}: invalid JSON" in run.log, tail(run)
    assert sorted(losses(run)) == [1, 2], tail(run)
    checkpoints = dump / "checkpoint"
    assert step_dirs(checkpoints) == ["step-2"]
    assert_verifies(checkpoints / "step-2")
    restart = train(dump, steps, *data, "--training.skip_bad_documents")
    assert restart.returncode == 0, tail(restart)
    assert f"skipping bad document {corpus}:{BAD_LINE}: invalid JSON" in restart.log
    assert_resumed(restart, 2)
    assert sorted(losses(restart)) == [3, 4]
    assert step_dirs(checkpoints) == ["step-2", "step-4"]
    assert_verifies(checkpoints / "step-4")
