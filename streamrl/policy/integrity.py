"""The digests of a policy version's files, and checking them before a backend loads them.

The learner hashes every file of a version directory (sha256, by path relative to it) after
writing it and before announcing it; the announcement (``PolicyVersion.digests``) carries them.
A rollout worker checks the files against the announcement before it loads anything: a byte
changed, a file truncated, missing or added is refused with ``PolicyIntegrityError``, the old
weights keep serving and the refusal is the worker's ``reload_error`` (policy health, ``status``),
so the run's staleness guard stops the run if no good version follows. The hf backend hashes
the bytes it then loads, so a file swapped between the check and the load cannot slip through.

A version announced without digests (by a streamrl older than the field, or a hand-made
announcement) is loaded unchecked, as before; the learner always sends them.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import structlog

from streamrl.policy.base import PolicyError
from streamrl.schema import PolicyVersion

log = structlog.get_logger(__name__)

_CHUNK = 1 << 20


class PolicyIntegrityError(PolicyError):
    """A policy version's files are not the ones the learner wrote."""


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_dir(directory: Path) -> dict[str, str]:
    """``{relative path: sha256 hex}`` of every file under ``directory``."""
    return {p.relative_to(directory).as_posix(): file_digest(p) for p in _files(directory)}


def verify_dir(
    directory: Path, digests: dict[str, str], read: tuple[str, ...] = ()
) -> dict[str, bytes]:
    """Check every file under ``directory`` against ``digests`` (no file missing, none added,
    every one matching) and return the bytes of the files named in ``read``, the ones that
    were hashed. Nothing to check (empty ``digests``): only reads."""
    if not digests:
        return {name: (directory / name).read_bytes() for name in read}
    if not directory.is_dir():
        raise PolicyIntegrityError(f"{directory}: policy version directory is missing")
    on_disk = {p.relative_to(directory).as_posix() for p in _files(directory)}
    missing = sorted(set(digests) - on_disk)
    added = sorted(on_disk - set(digests))
    if missing or added:
        raise PolicyIntegrityError(
            f"{directory}: files differ from the announced version "
            f"(missing {missing[:5]}, not announced {added[:5]}); refusing to load it"
        )
    kept: dict[str, bytes] = {}
    for name, expected in sorted(digests.items()):
        path = directory / name
        if name in read:
            data = path.read_bytes()
            actual = hashlib.sha256(data).hexdigest()
            kept[name] = data
        else:
            actual = file_digest(path)
        if actual != expected:
            raise PolicyIntegrityError(
                f"{path}: sha256 {actual[:16]}… does not match the announced {expected[:16]}… "
                f"({path.stat().st_size} bytes: tampered or truncated); refusing to load it"
            )
    return kept


async def check_served_version(pv: PolicyVersion, repeats: Any) -> None:
    """Before a server loads ``pv`` (the ``openai`` backend): refuse files that are not the
    learner's. The server reads ``pv.path`` itself; where this worker cannot see that path, it
    says so once (``repeats``: a ``streamrl.log.Repeats``)."""
    if not pv.digests:
        return
    if Path(pv.path).is_dir():
        await asyncio.to_thread(verify_dir, Path(pv.path), pv.digests)
    elif repeats.check("unverified", pv.path) is not None:
        log.warning(
            "policy version not checked: its directory is not visible to this worker",
            path=pv.path, policy_version=pv.version,
        )  # fmt: skip
