"""Typed experiment configuration: TOML files decode into these Structs, and the run's
``RunConfig`` is stored in Redis so that stateless workers read it instead of flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec

from streamrl import defaults as d


class _Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class PolicyConfig(_Cfg, kw_only=True):
    """Which backend answers the rollout workers, and its knobs."""

    backend: str = "scripted"  # scripted | hf | openai
    model: str = ""  # hf: a directory; openai: the served model name
    base_url: str = ""  # openai backend
    temperature: float = 1.0
    max_new_tokens: int = 64
    # scripted policy: deterministic per task_id
    latency_s: float = 0.0
    wrong_rate: float = 0.25
    malformed_rate: float = 0.0
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class RolloutConfig(_Cfg, kw_only=True):
    max_turns: int = d.MAX_TURNS
    max_tokens: int = d.MAX_EPISODE_TOKENS
    max_concurrent: int = d.MAX_CONCURRENT_EPISODES
    read_batch: int = d.READ_BATCH
    lease_seconds: float = d.LEASE_SECONDS
    drain_seconds: float = d.LEASE_DRAIN_SECONDS
    # A worker serving a policy more than [learner] max_staleness versions behind the newest
    # for this long fails its lease and faults the run (0: never).
    max_policy_lag_s: float = d.MAX_POLICY_LAG_S


class VerifyConfig(_Cfg, kw_only=True):
    timeout_s: float = d.VERIFY_TIMEOUT_S
    retries: int = d.VERIFY_RETRIES
    batch: int = d.VERIFY_BATCH
    lease_seconds: float = d.LEASE_SECONDS


class StreamConfig(_Cfg, kw_only=True):
    claim_idle_ms: int = d.CLAIM_IDLE_MS
    heartbeat_s: float = d.HEARTBEAT_S
    max_deliveries: int = d.MAX_DELIVERIES
    retention_ms: int = d.RETENTION_MS
    block_ms: int = d.READ_BLOCK_MS


class AdmissionConfig(_Cfg, kw_only=True):
    """The producer's gate (``[admission]``; see ``producer.LearnerAdmission``)."""

    # at most this fraction of what the learner consumes may be dropped (stale, zero-variance,
    # failed) and still let the producer push more; 1.0 lets every drop settle (no budget)
    max_drop_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = (
        d.ADMISSION_MAX_DROP_FRACTION
    )
    # wait while Redis used_memory is at or above this many MiB (0: only maxmemory's limit)
    redis_memory_mb: Annotated[float, msgspec.Meta(ge=0.0)] = d.ADMISSION_REDIS_MEMORY_MB
    # held on the drop budget with an empty pipeline: one probe push this often (0: never)
    drop_probe_s: Annotated[float, msgspec.Meta(ge=0.0)] = d.ADMISSION_DROP_PROBE_S


class RunConfig(_Cfg, kw_only=True):
    """Everything a worker needs to know about a run; lives at ``srl:{run}:config``."""

    v: int = d.SCHEMA_VERSION
    run: str = d.DEFAULT_RUN
    env: str = "counter"
    group_size: int = 4
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    verify: VerifyConfig = msgspec.field(default_factory=VerifyConfig)
    streams: StreamConfig = msgspec.field(default_factory=StreamConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    # The [learner] table, validated by the learner itself (streamrl.learner.config.
    # LearnerConfig): importing it here would pull torch into every worker.
    learner: dict[str, Any] = msgspec.field(default_factory=dict)


RUN_CONFIG = msgspec.msgpack.Decoder(RunConfig)


def load_toml(path: str | Path, type_: type[msgspec.Struct] = RunConfig) -> Any:
    """Decode a TOML file into ``type_``; unknown keys are errors, not silently ignored."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e}") from None
