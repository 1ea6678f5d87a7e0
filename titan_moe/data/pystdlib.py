"""The default real-text corpus: CPython's own standard library.

Every Python 3.11 install ships it, so a fresh machine can train on real text offline. Documents
are the stdlib's ``*.py`` files (code, comments, docstrings; ``pydoc_data/topics.py`` holds the
language reference text) plus its ``*.txt`` / ``*.rst`` documentation outside test folders; one
file is one document. Selection is deterministic: files sorted by relative path, shuffled with a
fixed seed, capped at ``max_bytes``; the first ``val_fraction`` of the shuffled documents is the
held-out ``val`` split. Layout: ``out/{train,val}/NNNNN.jsonl`` (``{"text": ...}`` per line) and
``out/manifest.json``, written last and atomically (a folder rename), so a folder with a manifest
is complete.
"""

import json
import os
import platform
import random
import shutil
import sysconfig
from pathlib import Path
from typing import Any

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
DOC_SUFFIXES = {".txt", ".rst"}
MANIFEST = "manifest.json"


def stdlib_files(stdlib_dir: Path) -> list[Path]:
    """Source and documentation files of the stdlib, as sorted paths relative to it."""
    found = []
    for root, dirs, names in os.walk(stdlib_dir):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        rel_root = Path(root).relative_to(stdlib_dir)
        in_tests = bool(TEST_DIRS.intersection(rel_root.parts))
        for name in names:
            suffix = Path(name).suffix
            if suffix == ".py" or (suffix in DOC_SUFFIXES and not in_tests):
                found.append(rel_root / name)
    return sorted(found)


def _read_text(path: Path) -> str | None:
    """The file as text, or None if it is not clean UTF-8 text (some test fixtures are not)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() and "\x00" not in text else None


def _write_split(folder: Path, docs: list[str], shard_bytes: int) -> dict[str, int]:
    folder.mkdir(parents=True)
    shard, size, n_shards = None, 0, 0
    for text in docs:
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        if shard is None or size >= shard_bytes:
            if shard is not None:
                shard.close()
            shard = (folder / f"{n_shards:05d}.jsonl").open("w", encoding="utf-8")
            size, n_shards = 0, n_shards + 1
        shard.write(line)
        size += len(line)
    if shard is not None:
        shard.close()
    return {
        "documents": len(docs),
        "bytes": sum(len(t.encode("utf-8")) for t in docs),
        "shards": n_shards,
    }


def prepare_pystdlib(
    out_dir: str | Path,
    max_bytes: int = 32 * 2**20,
    val_fraction: float = 0.02,
    seed: int = 0,
    shard_bytes: int = 8 * 2**20,
    force: bool = False,
    stdlib_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Write the corpus to ``out_dir`` (skipped if already there unless ``force``); its manifest."""
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST
    if manifest_path.is_file() and not force:
        return json.loads(manifest_path.read_text())
    partial = out_dir.is_dir() and any(out_dir.iterdir()) and not manifest_path.is_file()
    if partial and not force:
        raise FileExistsError(f"{out_dir} is not empty but has no {MANIFEST}; pass --force")

    source = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(source)
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for rel in files:
        path = source / rel
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        text = _read_text(path)
        if text is not None:
            docs.append(text)
            total += size
    n_val = max(1, round(val_fraction * len(docs)))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = {
        "source": str(source),
        "python": platform.python_version(),
        "seed": seed,
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "splits": {
            "val": _write_split(tmp / "val", docs[:n_val], shard_bytes),
            "train": _write_split(tmp / "train", docs[n_val:], shard_bytes),
        },
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if force:
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        # Another process (e.g. another rank) finished first; its identical copy stands.
        shutil.rmtree(tmp, ignore_errors=True)
        if not manifest_path.is_file():
            raise
    return manifest
