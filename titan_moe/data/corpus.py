"""Reading a user's text corpus as one ordered stream of documents.

The stream is ``docs(f_1) ++ docs(f_2) ++ ...`` over the data files in sorted relative-path
order, where a ``.jsonl`` file contributes one document per non-blank line (its ``text_field``),
a ``.parquet`` file one per row of column ``text_field``, and a ``.txt`` file is one document.
Document ``i`` of that stream has the same index on every rank and every run, which is what
sharding (``i mod n_shards``) and exact resume (``next index``) are built on.

A document that cannot be read (invalid JSON, no string ``text_field``, bytes that are not UTF-8)
is a ``BadDocument`` whose message starts with ``file:line`` (``file:row N`` for parquet). It
keeps its index in the stream: it is raised, or handed to ``on_bad``, which skips it.
"""

import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".parquet", ".txt")


class BadDocument(ValueError):
    """A document that cannot be read; the message starts with where it is (file:line)."""


OnBad = Callable[[BadDocument], None] | None


def _bad(error: BadDocument, on_bad: OnBad) -> None:
    if on_bad is None:
        raise error
    on_bad(error)


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


def _jsonl_text(line: bytes, text_field: str) -> str:
    """The document of one jsonl line; BadDocument (without the place) if there is none."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadDocument(f"not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
    except json.JSONDecodeError as e:
        raise BadDocument(f"invalid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise BadDocument(f"has no field {text_field!r}")
    if not isinstance(record[text_field], str):
        raise BadDocument(f"field {text_field!r} is not a string")
    return record[text_field]


def _jsonl_documents(
    file: Path, text_field: str, first: int, wanted: Selection, on_bad: OnBad
) -> Generator[tuple[int, str], None, int]:
    index = first
    with file.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if index in wanted:
                try:
                    text = _jsonl_text(line, text_field)
                except BadDocument as e:
                    _bad(BadDocument(f"{file}:{line_no}: {e}"), on_bad)
                else:
                    yield index, text
            index += 1
    return index - first


def _parquet_documents(
    file: Path, text_field: str, first: int, wanted: Selection, on_bad: OnBad
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
                if index + offset not in wanted:
                    continue
                if isinstance(text, str):
                    yield index + offset, text
                else:
                    row = index + offset - first
                    bad = BadDocument(f"{file}:row {row}: field {text_field!r} is not a string")
                    _bad(bad, on_bad)
        index += rows
    return index - first


def _text_document(
    file: Path, text_field: str, first: int, wanted: Selection, on_bad: OnBad
) -> Generator[tuple[int, str], None, int]:
    if first in wanted:
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            _bad(BadDocument(f"{file}:{line}: not UTF-8 ({e.reason} at byte {e.start})"), on_bad)
        else:
            yield first, text
    return 1


_READERS = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents, ".txt": _text_document}


def iter_documents(
    files: list[Path],
    text_field: str = "text",
    start: int = 0,
    stride: int = 1,
    on_bad: OnBad = None,
) -> Iterator[tuple[int, str]]:
    """Yield ``(i, text)`` for stream indices ``i = start, start + stride, ...``.

    Documents that are not wanted are counted but not decoded (jsonl lines are not parsed,
    .txt files are not read, parquet row groups are not loaded), so a shard reads only its own
    documents and a resume skips to ``start`` cheaply. A bad wanted document raises BadDocument,
    or with ``on_bad`` is passed to it and not yielded.
    """
    wanted = Selection(start, stride)
    index = 0
    for file in files:
        index += yield from _READERS[file.suffix](file, text_field, index, wanted, on_bad)
