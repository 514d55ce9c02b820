"""Weight publishing: a policy version on disk, announced on the ``policy`` stream.

Layout (``<output_dir>/policy/``)::

    v3/                          full model (format "safetensors")
        model.safetensors        one file, every weight
        config.json  generation_config.json  tokenizer.json  tokenizer_config.json ...
    v3/                          under LoRA (format "lora")
        adapter_model.safetensors  adapter_config.json  (base_model_name_or_path = the base)
        tokenizer files

A version directory is written as ``.tmp-v3-…``, fsynced and renamed, so a backend that sees
``v3/`` sees all of it. The announcement is a ``PolicyVersion`` (msgpack, field ``p``) on
``keys.policy``, with the sha256 of every file of the directory (``digests``), read back from
disk after the rename: rollout workers refuse files that do not match. Publishing is
idempotent: after a crash the learner replays its last steps and may publish a version again;
an existing directory is kept and a version the stream already announced is not announced
twice.

A learner publishes through one ``Publisher``: after its first full-model version, the files
that never change in training (config, generation config, tokenizer) are hard links to that
version's, with their digests remembered, so each later version writes, fsyncs and hashes only
``model.safetensors``, and the stream's newest version is read once, not before every
announcement (on the tiny model these took ~a fifth of a learner step).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import structlog

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.learner._failpoints import failpoint
from streamrl.learner.checkpoint import fsync_path, write_failure
from streamrl.models.tied_head import WEIGHTS_FILE, write_explicit_head
from streamrl.policy.integrity import digest_dir, file_digest

_TMP_PREFIX = ".tmp-"
log = structlog.get_logger("streamrl.learner")


class PublishFailed(RuntimeError):
    """A version's files could not be written; nothing of it is on disk or announced."""


def _version_dir(policy_dir: Path, version: int) -> Path:
    return policy_dir / f"v{version}"


@dataclass
class _Static:
    """The files of a version this process wrote that are the same in every version (all but
    the weights), and their digests."""

    source: Path
    digests: dict[str, str] = field(default_factory=dict)

    def usable(self) -> bool:
        return all((self.source / name).is_file() for name in self.digests)


class _NoLinks(OSError):
    """The filesystem refused a hard link (some network and FUSE filesystems do)."""


def _link_static(static: _Static, tmp: Path) -> None:
    tmp.mkdir()
    try:
        for name in static.digests:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(static.source / name, tmp / name)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _NoLinks(str(e)) from e


def _write_policy(
    model: Any,
    tokenizer: Any,
    policy_dir: Path,
    version: int,
    state_dict: dict[str, Any] | None = None,
    static: _Static | None = None,
) -> Path:
    """Write the weights of ``version`` unless they are already on disk; ``state_dict``: the
    whole weights when ``model`` holds only shards of them (FSDP); ``static``: hard-link the
    unchanging files from there instead of writing them (their data is already durable)."""
    final = _version_dir(policy_dir, version)
    if final.is_dir():
        return final
    policy_dir.mkdir(parents=True, exist_ok=True)
    tmp = policy_dir / f"{_TMP_PREFIX}v{version}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # else a "Writing model shards" bar per version in the log
    if static is not None:
        _link_static(static, tmp)  # or _NoLinks, nothing left behind
    try:
        if static is not None:
            _save_weights(model, tmp)
            fsync_path(tmp / WEIGHTS_FILE)
        else:
            if _one_file(model, state_dict):
                _save_full(model, tmp)
            else:  # an adapter, or FSDP's gathered weights: transformers' and peft's layout
                model.save_pretrained(tmp, max_shard_size="1000GB", state_dict=state_dict)
                write_explicit_head(tmp)  # a tied head reaches vLLM's reload (models.tied_head)
            tokenizer.save_pretrained(tmp)
            for f in tmp.rglob("*"):
                if f.is_file():
                    fsync_path(f)
        fsync_path(tmp)
    except Exception as e:  # a full disk: nothing half-written stays, nothing is announced
        shutil.rmtree(tmp, ignore_errors=True)
        raise PublishFailed(
            f"policy version {version} not written ({write_failure(e, policy_dir)})"
        ) from e
    os.rename(tmp, final)
    fsync_path(policy_dir)
    return final


def _one_file(model: Any, state_dict: dict[str, Any] | None) -> bool:
    """Whether the version is a whole model this process holds, written by ``_save_full``
    (not an adapter, not FSDP's gathered weights)."""
    return state_dict is None and not hasattr(model, "peft_config")


def _save_full(model: Any, directory: Path) -> None:
    """What ``save_pretrained`` then ``write_explicit_head`` write for a whole model (its
    config, generation config and one ``model.safetensors`` holding every weight, a tied head
    as its own copy), with the weights written once: those two passes wrote SmolLM2's 540 MB
    twice and read them back once in between (a version took 1.5-1.7 s, now 1.1-1.3 s, digest
    included, on a 2-core VM)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    _save_weights(model, directory)


def _save_weights(model: Any, directory: Path) -> None:
    """Every weight in one ``model.safetensors``, a tied head as its own copy."""
    from safetensors.torch import save_file

    seen: set[tuple] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)
        # a tied head shares the embedding's storage, which safetensors refuses: a copy
        t = t.detach().cpu()
        tensors[name] = t.clone() if key in seen else t.contiguous()
        seen.add(key)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def _last_announced(r: redis.Redis, keys: Keys) -> int:
    """The newest version on the policy stream, -1 if none."""
    rows = r.xrevrange(keys.policy, count=1)
    if not rows:
        return -1
    _id, fields = rows[0]
    return schema.POLICY_VERSION.decode(fields[b"p"]).version


def _prune(policy_dir: Path, newest: int, keep: int) -> None:
    """Delete versions older than the ``keep`` newest, and half-written ones."""
    if not policy_dir.is_dir():
        return
    for p in policy_dir.iterdir():
        old = p.name.startswith("v") and p.name[1:].isdigit() and int(p.name[1:]) <= newest - keep
        if old or p.name.startswith(_TMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True)


class Publisher:
    """One learner's publishing: what it can reuse from its own last version (``_Static``)
    and the newest version it knows the stream has."""

    def __init__(self) -> None:
        self._static: _Static | None = None
        self._links = True  # False once the filesystem refused one
        self._announced: int | None = None

    def publish(
        self,
        r: redis.Redis,
        keys: Keys,
        model: Any,
        tokenizer: Any,
        policy_dir: Path,
        version: int,
        step: int,
        lora: bool,
        keep: int,
        state_dict: dict[str, Any] | None = None,
    ) -> schema.PolicyVersion | None:
        """Write, digest and announce ``version``; None (logged, nothing announced) when the
        files cannot be written, as on a full disk. ``state_dict``: see ``_write_policy``."""
        full = not lora and _one_file(model, state_dict)
        static = self._static if full and self._static and self._static.usable() else None
        existed = _version_dir(policy_dir, version).is_dir()
        try:
            try:
                path = _write_policy(model, tokenizer, policy_dir, version, state_dict, static)
            except _NoLinks as e:
                log.warning("no hard links here: every version writes all its files", error=str(e))
                self._static, self._links, static = None, False, None
                path = _write_policy(model, tokenizer, policy_dir, version, state_dict)
        except PublishFailed as e:
            log.error(str(e), step=step)
            return None
        failpoint("after_policy_write", step)
        if static is not None and not existed:
            digests = {**static.digests, WEIGHTS_FILE: file_digest(path / WEIGHTS_FILE)}
            static.source = path  # the newest: the last one pruned
        else:
            digests = digest_dir(path)
            if full and not existed and self._links:
                rest = {k: v for k, v in digests.items() if k != WEIGHTS_FILE}
                self._static = _Static(path, rest)
        pv = schema.PolicyVersion(
            version=version,
            step=step,
            path=str(path.resolve()),
            format="lora" if lora else "safetensors",
            created_at=schema.now(),
            digests=digests,
        )
        self._announce(r, keys, pv)
        failpoint("after_announce", step)
        _prune(policy_dir, version, keep)
        return pv

    def _announce(self, r: redis.Redis, keys: Keys, version: schema.PolicyVersion) -> bool:
        """XADD the announcement unless the stream already has this version or a newer one
        (read from the stream once; after that, this learner is who adds to it)."""
        if self._announced is None:
            self._announced = _last_announced(r, keys)
        if self._announced >= version.version:
            return False
        r.xadd(keys.policy, {"p": schema.encode(version)})
        self._announced = version.version
        return True


def publish(
    r: redis.Redis,
    keys: Keys,
    model: Any,
    tokenizer: Any,
    policy_dir: Path,
    version: int,
    step: int,
    lora: bool,
    keep: int,
    state_dict: dict[str, Any] | None = None,
) -> schema.PolicyVersion | None:
    """One version by a fresh ``Publisher`` (nothing reused)."""
    return Publisher().publish(
        r, keys, model, tokenizer, policy_dir, version, step, lora, keep, state_dict
    )
