"""Datasets as rows: a JSONL file, a Hugging Face ``datasets`` directory (``save_to_disk``), a
Parquet file or an Arrow file, each read as a list of rows that the producer pushes one prompt
per row. One bad row costs that row: it is dead-lettered with where it is (``file:line`` for
JSONL, ``file[index]`` for the others, index 0-based as in ``dataset[index]``).

A row's prompt is its ``prompt`` column in TRL's standard form (a string) or conversational
form (a list of ``{"role", "content"}`` messages); ``columns`` renames columns first (``{"prompt":
"question"}`` reads the prompt from ``question``), so a dataset is used as it was saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from streamrl.producer.rows import default_id, read_rows
from streamrl.responses import parse_row

FORMATS = ("jsonl", "datasets directory", "parquet", "arrow")


class DatasetError(ValueError):
    """A dataset that cannot be opened at all (not one bad row: those are dead-lettered)."""


@dataclass
class Rows:
    """A dataset's rows, read by index: ``row(i)`` is the parsed row or raises ValueError."""

    path: Path
    source: str  # the producer's position key: the same dataset resumes where it stopped
    columns: Mapping[str, str] = field(default_factory=dict)  # new name -> column it reads

    def __len__(self) -> int:
        raise NotImplementedError

    def where(self, i: int) -> str:
        return f"{self.path.name}[{i}]"

    def place(self, i: int) -> str:
        return f"row {i}"

    def default_id(self, i: int) -> str:
        return default_id(self.path, i)

    def fetch(self, start: int, end: int) -> list[Any]:
        """Rows ``start..end-1``: each a dict, a ValueError saying why it is bad, or None (a
        blank JSONL line, which is no row at all)."""
        raise NotImplementedError

    def raw(self, i: int) -> bytes:
        """What a dead letter keeps of row ``i``."""
        raise NotImplementedError

    def renamed(self, row: Any) -> Any:
        if not self.columns or not isinstance(row, dict):
            return row
        out = {k: v for k, v in row.items() if k not in self.columns.values()}
        for new, old in self.columns.items():
            if old not in row:
                raise ValueError(f"no column {old!r} (columns: {', '.join(map(str, row))})")
            out[new] = row[old]
        return out


@dataclass
class JsonlRows(Rows):
    lines: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lines)

    def where(self, i: int) -> str:
        return f"{self.path.name}:{i + 1}"

    def place(self, i: int) -> str:
        return f"line {i + 1}"

    def fetch(self, start: int, end: int) -> list[Any]:
        out: list[Any] = []
        for line in self.lines[start:end]:
            if not line.strip():
                out.append(None)
                continue
            try:
                out.append(self.renamed(parse_row(line)))
            except ValueError as e:
                out.append(e)
        return out

    def raw(self, i: int) -> bytes:
        return self.lines[i]


@dataclass
class TableRows(Rows):
    """A pyarrow Table (a Parquet or Arrow file, or a saved ``datasets`` split's data)."""

    table: Any = None

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def fetch(self, start: int, end: int) -> list[Any]:
        out: list[Any] = []
        for row in self.table.slice(start, end - start).to_pylist():
            try:
                out.append(self.renamed(row))
            except ValueError as e:
                out.append(e)
        return out

    def raw(self, i: int) -> bytes:
        (row,) = self.table.slice(i, 1).to_pylist()
        return msgspec.json.encode(row, enc_hook=repr)


def open_rows(
    path: str | Path,
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
    limit: int | None = None,
) -> Rows:
    """The rows of the dataset at ``path``, its format found from what it is: a directory
    written by ``save_to_disk`` (a ``Dataset``, or one ``split`` of a ``DatasetDict``),
    ``*.parquet``, ``*.arrow`` (Arrow IPC file or stream, as ``datasets`` writes its cache),
    anything else JSONL. ``limit``: only the first N rows."""
    path = Path(path)
    cols = dict(columns or {})
    if path.is_dir():
        table, source = _saved_dataset(path, split)
    elif path.suffix == ".parquet":
        table, source = _parquet(path), f"parquet:{path.resolve()}"
    elif path.suffix in (".arrow", ".feather", ".ipc"):
        table, source = _arrow(path), f"arrow:{path.resolve()}"
    else:
        lines = list(read_rows(path))[:limit]
        return JsonlRows(path, f"file:{path.resolve()}", cols, lines)
    if limit is not None:
        table = table.slice(0, limit)
    return TableRows(path, source, cols, table)


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, memory_map=True)
    except Exception as e:  # pyarrow's own errors: not a Parquet file, a truncated one
        raise DatasetError(f"{path}: not a readable Parquet file: {e}") from None


def _arrow(path: Path) -> Any:
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
    try:
        return pa.ipc.open_stream(source).read_all()
    except Exception as e:
        raise DatasetError(f"{path}: not an Arrow IPC file or stream: {e}") from None


def _saved_dataset(path: Path, split: str | None) -> tuple[Any, str]:
    """A ``save_to_disk`` directory's rows as one table (indices of a ``select`` or ``shuffle``
    applied), and its source name (with the split)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{path} is a directory: reading a saved dataset needs the `datasets` package "
            "(pip install 'streamrl[datasets]')"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: not a directory written by save_to_disk: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in ds:
            raise DatasetError(
                f"{path} holds the splits {', '.join(splits)}: give --split"
                + (f" (no split {split!r})" if split else "")
            )
        ds = ds[split]
    elif split is not None:
        raise DatasetError(f"{path} is one Dataset, not a DatasetDict: it has no splits")
    table = ds.data.table
    if ds._indices is not None:  # a select/shuffle kept as an indices mapping
        table = table.take(ds._indices.column(0))
    return table, f"datasets:{path.resolve()}" + (f":{split}" if split else "")
