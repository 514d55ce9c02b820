"""Records of a wandb run's ``run-<id>.wandb`` file, for tests.

wandb 0.31 no longer ships a Python reader for its transaction log. The file is LevelDB's log
format (32 KiB blocks; each chunk: crc32c, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte
``:W&B`` header; each record is a ``wandb_internal_pb2.Record``, parsed with wandb's own
protobuf classes."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B"
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes) -> Iterator[bytes]:
    """The payloads of the log's records, reassembled from their chunks."""
    if not data.startswith(HEADER):
        raise ValueError("not a wandb transaction log")
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's trailer is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            parts.append(body)
            yield b"".join(parts)
            parts = []


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    for payload in chunks(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        yield rec


def history(path: Path) -> list[dict]:
    """Every ``run.log`` row, keys as logged, values JSON-decoded."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows


def config(path: Path) -> dict:
    out: dict = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        updates = (
            rec.run.config.update
            if kind == "run"
            else (rec.config.update if kind == "config" else [])
        )
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
