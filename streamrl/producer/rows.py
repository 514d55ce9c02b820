"""Reading a JSONL dataset a row at a time: one bad byte or one bad row costs that row, not
the file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def read_rows(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes: each one is decoded on its own, so that one bad byte costs
    one row, not the file. A UTF-8 byte order mark at the start is dropped."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            yield line.rstrip(b"\r\n")


def default_id(path: Path, line_no: int) -> str:
    """The prompt id of a row that names none: the file's stem and its 1-based line number."""
    return f"{path.stem}-{line_no + 1:07d}"
