"""Reading a user's text corpus as one ordered stream of documents.

The stream is ``docs(f_1) ++ docs(f_2) ++ ...`` over the data files in sorted relative-path
order, where a ``.jsonl`` file contributes one document per non-blank line (its ``text_field``),
a ``.parquet`` file one per row of column ``text_field``, and a ``.txt`` file is one document.
Document ``i`` of that stream has the same index on every rank and every run, which is what
sharding (``i mod n_shards``) and exact resume (``next index``) are built on.
"""

import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".parquet", ".txt")


def resolve_split(path: str | Path, split: str) -> Path:
    """``path/split`` if that folder exists (a prepared train/val layout), else ``path``."""
    path = Path(path)
    return path / split if (path / split).is_dir() else path


def list_data_files(path: str | Path) -> list[Path]:
    """The data files under ``path`` (or ``path`` itself), sorted, hidden entries skipped."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if path.is_file():
        files = [path] if path.suffix in DATA_SUFFIXES else []
    else:
        files = sorted(
            f
            for f in path.rglob("*")
            if f.is_file()
            and f.suffix in DATA_SUFFIXES
            and not any(part.startswith(".") for part in f.relative_to(path).parts)
        )
    if not files:
        raise FileNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files found under {path}")
    return files


@dataclass(frozen=True)
class Selection:
    """Stream indices ``start, start + stride, start + 2 * stride, ...``."""

    start: int = 0
    stride: int = 1

    def __contains__(self, i: int) -> bool:
        return i >= self.start and (i - self.start) % self.stride == 0

    def hits(self, lo: int, hi: int) -> bool:
        """Whether any selected index lies in ``[lo, hi)``."""
        first = self.start + max(0, -(-(lo - self.start) // self.stride)) * self.stride
        return first < hi


def _jsonl_documents(
    file: Path, text_field: str, first: int, wanted: Selection
) -> Generator[tuple[int, str], None, int]:
    index = first
    with file.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if index in wanted:
                record = json.loads(line)
                if text_field not in record:
                    raise KeyError(f"{file}:{line_no} has no field {text_field!r}")
                yield index, record[text_field]
            index += 1
    return index - first


def _parquet_documents(
    file: Path, text_field: str, first: int, wanted: Selection
) -> Generator[tuple[int, str], None, int]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {file} needs pyarrow: pip install pyarrow") from e
    parquet = pq.ParquetFile(file)
    if text_field not in parquet.schema_arrow.names:
        raise KeyError(f"{file} has no column {text_field!r}")
    index = first
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if wanted.hits(index, index + rows):
            table = parquet.read_row_group(group, columns=[text_field])
            for offset, text in enumerate(table.column(0).to_pylist()):
                if index + offset in wanted:
                    yield index + offset, text
        index += rows
    return index - first


def _text_document(
    file: Path, text_field: str, first: int, wanted: Selection
) -> Generator[tuple[int, str], None, int]:
    if first in wanted:
        yield first, file.read_text(encoding="utf-8")
    return 1


_READERS = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents, ".txt": _text_document}


def iter_documents(
    files: list[Path], text_field: str = "text", start: int = 0, stride: int = 1
) -> Iterator[tuple[int, str]]:
    """Yield ``(i, text)`` for stream indices ``i = start, start + stride, ...``.

    Documents that are not wanted are counted but not decoded (jsonl lines are not parsed,
    .txt files are not read, parquet row groups are not loaded), so a shard reads only its own
    documents and a resume skips to ``start`` cheaply.
    """
    wanted = Selection(start, stride)
    index = 0
    for file in files:
        index += yield from _READERS[file.suffix](file, text_field, index, wanted)
