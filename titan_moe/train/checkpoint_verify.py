"""Verified checkpoints: a manifest per step folder, checked before torchtitan loads it.

torchtitan 0.2.2's CheckpointManager saves `<dump>/<checkpoint.folder>/step-N/` with DCP (every
rank writes its `__<rank>_<i>.distcp` shards into the one folder, the coordinator then writes
`.metadata`) and on resume loads the newest step-N holding a `.metadata` (`_find_load_step`).
Nothing checks the bytes: a damaged shard loads silently, a truncated one ends the run in an
EOFError. Nor is the model compared: a model of another size loads whatever keys match.

After the save returned on every rank (all shards and `.metadata` written), rank 0 writes
`step-N/manifest.json`: {"format": 1, "model_args": {...}, "files": {relative path: {"bytes",
"sha256"}}} over every other file in the folder, written to a temporary name and renamed, so a
manifest is whole or absent. A step folder without one was cut short (or predates manifests).

Before torchtitan's `load`, rank 0 picks the step (the result is broadcast, so the files are
read once and every rank loads the same step or raises the same error):
- resume (load_step -1): the newest step-N that verifies; each newer one is skipped with a
  warning saying why (no manifest, a file missing, truncated or with other bytes);
- an explicit `checkpoint.load_step`, or an `initial_load_path` that has a manifest: verified,
  CheckpointError naming the file if it does not.
The manifest's model args are compared first: a difference is a config error, not damage, so it
raises ModelArgsMismatch naming each field (checkpoint vs config value) instead of falling back.

Async checkpointing is rejected: the manifest would have to wait for the background upload.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

MANIFEST = "manifest.json"
FORMAT = 1
# Model args that may differ between save and load: max_seq_len follows training.seq_len
# (context stages grow it), kda_backend picks a kernel implementation; neither shapes a weight.
UNCOMPARED_ARGS = frozenset({"max_seq_len", "kda_backend"})
_ABSENT = "<absent>"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged; the message names the folder or file."""


class ModelArgsMismatch(ValueError):
    """A checkpoint saved for other model args; the message names each differing field."""


def model_args_json(model_args: Any) -> dict[str, Any]:
    """The model args as JSON reads them back (tuples become lists), for comparison."""
    return json.loads(json.dumps(dataclasses.asdict(model_args)))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(step_dir: Path, model_args: Any) -> None:
    """Write step_dir/manifest.json: size and sha256 of every file in it, and the model args.
    A temporary manifest left by a save killed while writing it is not one of the step's files
    (it is overwritten below, then renamed away)."""
    partial = step_dir / f".{MANIFEST}.partial"
    files = sorted(p for p in step_dir.rglob("*")
                   if p.is_file() and p.name != MANIFEST and p != partial)
    manifest = {
        "format": FORMAT,
        "model_args": model_args_json(model_args),
        "files": {str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                  for p in files},
    }
    with partial.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, step_dir / MANIFEST)


def compare_model_args(saved: dict[str, Any], model_args: Any, step_dir: Path) -> None:
    """Raise ModelArgsMismatch naming every field where the checkpoint and config differ."""
    current = model_args_json(model_args)
    differing = [
        f"{name}: checkpoint {saved.get(name, _ABSENT)!r} vs config {current.get(name, _ABSENT)!r}"
        for name in sorted((saved.keys() | current.keys()) - UNCOMPARED_ARGS)
        if saved.get(name, _ABSENT) != current.get(name, _ABSENT)
    ]
    if differing:
        raise ModelArgsMismatch(
            f"checkpoint {step_dir} was saved for other model args: {'; '.join(differing)}; "
            "train with the checkpoint's model config, or start a fresh checkpoint.folder")


def verify_checkpoint(step_dir: Path, model_args: Any) -> None:
    """Raise unless step_dir has a manifest for these model args (ModelArgsMismatch) that its
    files match (CheckpointError naming the first file that does not)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{step_dir} has no {MANIFEST}: its save was cut short, or it predates manifests")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from e
    compare_model_args(manifest["model_args"], model_args, step_dir)
    for name, want in manifest["files"].items():
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, the manifest {want['bytes']} "
                                  "(truncated or overwritten)")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file} is damaged: its sha256 differs from the manifest's")


def newest_verified_step(folder: Path, model_args: Any) -> int:
    """The newest step-N under folder that verifies, or -1; logs each newer one skipped."""
    steps = sorted((int(m.group(1)) for p in folder.iterdir()
                    if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()), reverse=True)
    for step in steps:
        try:
            verify_checkpoint(folder / f"step-{step}", model_args)
            return step
        except CheckpointError as e:
            logger.warning(f"Skipping checkpoint step-{step}: {e}")
    if steps:
        logger.warning(f"No checkpoint under {folder} verifies; training starts from scratch")
    return -1


def _on_rank0(compute: Callable[[], Any]) -> Any:
    """compute() run on rank 0 only (the files are read once) and its result, or its error,
    handed to every rank, so that no rank is left waiting in a collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [(compute(), None)]
        except Exception as e:  # any error: re-raised on every rank below
            outcome = [(None, e)]
    dist.broadcast_object_list(outcome, src=0)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


class VerifiedCheckpoints:
    """Wraps a CheckpointManager's save (a manifest after each save) and load (of a step that
    verifies; nothing when resume finds none)."""

    def __init__(self, checkpointer: CheckpointManager, model_args: Any) -> None:
        self.checkpointer = checkpointer
        self.model_args = model_args
        if not checkpointer.enable:
            return
        if checkpointer.async_mode != AsyncMode.DISABLED:
            raise ValueError(
                f"checkpoint.async_mode = {checkpointer.async_mode.value!r} is not supported: "
                "checkpoints are verified by a manifest written after the save completes; "
                "use async_mode = \"disabled\"")
        self._save, self._load = checkpointer.save, checkpointer.load
        checkpointer.save, checkpointer.load = self.save, self.load

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """The wrapped save; when it saved, rank 0 writes the step's manifest."""
        saving = self.checkpointer._should_save(curr_step, last_step)
        self._save(curr_step, last_step)
        if saving and (not dist.is_initialized() or dist.get_rank() == 0):
            write_manifest(Path(self.checkpointer._create_checkpoint_id(curr_step)),
                           self.model_args)

    def load(self, step: int = -1) -> bool:
        """The wrapped load, of the step `step_to_load` picks on rank 0; False if none."""
        step = _on_rank0(lambda: self.step_to_load(step))
        return step is not None and self._load(step)

    def step_to_load(self, step: int) -> int | None:
        """The step for torchtitan's load: -1 resolved to the newest that verifies (None when
        none does), an explicit step verified; -1 kept when the folder does not exist yet
        (torchtitan then loads initial_load_path, verified here when it has a manifest)."""
        folder = Path(self.checkpointer.folder)
        if not folder.is_dir():
            initial = self.checkpointer.initial_load_path
            if initial and (Path(initial) / MANIFEST).is_file():
                verify_checkpoint(Path(initial), self.model_args)
            return step
        if step != -1:
            verify_checkpoint(Path(self.checkpointer._create_checkpoint_id(step)),
                              self.model_args)
            return step
        found = newest_verified_step(folder, self.model_args)
        return None if found == -1 else found
