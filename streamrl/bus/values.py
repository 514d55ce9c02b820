"""Values as Redis returns them: bytes to text, and stream entry IDs to sortable pairs.

One helper each, so that every reader decodes a reply and orders offsets the same way.
"""

from __future__ import annotations

from typing import Any


def as_str(value: Any) -> str:
    """A reply value as text: bytes are UTF-8, anything else goes through ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def id_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry ID (``<ms>-<seq>`` or ``<ms>``) as a sortable pair (ms, seq); a
    ``ValueError`` for anything else."""
    ms, _, seq = as_str(entry_id).partition("-")
    if not ms.isdigit() or not (seq == "" or seq.isdigit()):
        raise ValueError(f"{as_str(entry_id)!r} is not a stream entry ID")
    return int(ms), int(seq or 0)
