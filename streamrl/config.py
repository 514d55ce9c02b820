"""Typed experiment configuration: TOML files decode into these Structs, and the run's
``RunConfig`` is stored in Redis so that stateless workers read it instead of flags."""

from __future__ import annotations

import re
import string
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from streamrl import defaults as d

JUDGE = "judge"  # the verifier name of the [judge] table


class _Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


# Ranges, checked wherever a config is decoded (TOML, Redis): a bad value is one message that
# names the field, not a worker spinning on it later.
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Backend = Literal["scripted", "hf", "openai"]
# a run name sits inside a Redis Cluster hash tag, {run}: no braces, no spaces
RunName = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[^{}\s]+$")]


class PolicyConfig(_Cfg, kw_only=True):
    """Which backend answers the rollout workers, and its knobs."""

    backend: Backend = "scripted"
    model: str = ""  # hf: a directory; openai: the served model name
    # openai backend: a server, or several (each rollout worker is given one, balanced)
    base_url: str | list[str] = ""
    temperature: NonNegative = 1.0  # 0: greedy
    max_new_tokens: AtLeastOne = 64
    # scripted policy: deterministic per task_id
    latency_s: NonNegative = 0.0
    wrong_rate: Fraction = 0.25
    malformed_rate: Fraction = 0.0
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class RolloutConfig(_Cfg, kw_only=True):
    max_turns: AtLeastOne = d.MAX_TURNS
    max_tokens: AtLeastOne = d.MAX_EPISODE_TOKENS
    max_concurrent: AtLeastOne = d.MAX_CONCURRENT_EPISODES
    read_batch: AtLeastOne = d.READ_BATCH
    lease_seconds: Positive = d.LEASE_SECONDS
    drain_seconds: NonNegative = d.LEASE_DRAIN_SECONDS
    # A worker serving a policy more than [learner] max_staleness versions behind the newest
    # for this long fails its lease and faults the run (0: never).
    max_policy_lag_s: NonNegative = d.MAX_POLICY_LAG_S
    # A session key outlives its last committed turn by this long, then expires: what is left
    # of an abandoned task (its entry trimmed, its run given up) cleans itself up.
    session_ttl_s: AtLeastOne = d.SESSION_TTL_S


class VerifyConfig(_Cfg, kw_only=True):
    timeout_s: Positive = d.VERIFY_TIMEOUT_S
    retries: Annotated[int, msgspec.Meta(ge=0)] = d.VERIFY_RETRIES
    batch: AtLeastOne = d.VERIFY_BATCH
    lease_seconds: Positive = d.LEASE_SECONDS


class JudgeConfig(_Cfg, kw_only=True):
    """An LLM judge (``verifier = "judge"``; see ``streamrl.verifiers.judge``): where it is,
    what it is asked, how its answer becomes a reward, and how hard the run may call it."""

    base_url: Annotated[str, msgspec.Meta(min_length=1)]  # OpenAI-compatible; /v1 optional
    model: Annotated[str, msgspec.Meta(min_length=1)]
    # str.format fields: {prompt}, {response} and each of the task's data columns
    prompt: Annotated[str, msgspec.Meta(min_length=1)]
    system: str = ""
    # the first group of the first match is the grade N; reward = (N - min) / (max - min)
    score_pattern: str = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
    min_score: float = 0.0
    max_score: Positive = 10.0
    version: str = "1"  # bump it when the judge's model or scale changes behind the same config
    max_tokens: AtLeastOne = d.JUDGE_MAX_TOKENS
    temperature: NonNegative = 0.0
    # one pool per endpoint across every verifier worker of the run
    max_in_flight: AtLeastOne = d.JUDGE_MAX_IN_FLIGHT
    max_per_second: NonNegative = d.JUDGE_MAX_PER_SECOND  # 0: unlimited
    timeout_s: Positive = d.JUDGE_TIMEOUT_S
    retries: Annotated[int, msgspec.Meta(ge=0)] = d.JUDGE_RETRIES
    backoff_s: NonNegative = d.JUDGE_BACKOFF_S
    backoff_max_s: NonNegative = d.JUDGE_BACKOFF_MAX_S
    # a 429 or 503 holds every call of the run off the endpoint for its Retry-After (backoff_s
    # without one), at most this long; the told call's next attempt waits as long
    retry_after_max_s: NonNegative = d.JUDGE_RETRY_AFTER_MAX_S
    cache_ttl_s: Annotated[int, msgspec.Meta(ge=0)] = d.JUDGE_CACHE_TTL_S  # 0: no cache
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the key, never the key

    def __post_init__(self) -> None:
        if self.min_score >= self.max_score:
            raise ValueError(
                f"judge.min_score ({self.min_score}) must be below max_score ({self.max_score})"
            )
        try:  # both are read on every call: a mistake in them is one message here, not N failures
            groups = re.compile(self.score_pattern).groups
            fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt) if f is not None]
        except (re.error, ValueError) as e:
            raise ValueError(f"judge: bad score_pattern or prompt template: {e}") from None
        if groups < 1:
            raise ValueError("judge.score_pattern needs a group, (...), around the score")
        if any(not f.isidentifier() for f in fields):
            raise ValueError(
                f"judge.prompt: fields are plain names ({{prompt}}, {{response}}, a data column); "
                f"got {[f for f in fields if not f.isidentifier()]} (write a literal brace twice)"
            )


class StreamConfig(_Cfg, kw_only=True):
    claim_idle_ms: AtLeastOne = d.CLAIM_IDLE_MS
    heartbeat_s: Positive = d.HEARTBEAT_S
    max_deliveries: AtLeastOne = d.MAX_DELIVERIES
    retention_ms: Annotated[int, msgspec.Meta(ge=0)] = d.RETENTION_MS
    block_ms: AtLeastOne = d.READ_BLOCK_MS  # 0 would block for ever
    # how long a finished group's marker stays (it turns away late duplicate scores); Redis
    # holds about rate x this many markers (a small hash each)
    group_done_ttl_s: AtLeastOne = d.GROUP_DONE_TTL_S
    # split the run's streams into this many shards, each its own hash tag {run:s}, so that
    # a Redis Cluster spreads the run over its nodes (streamrl.bus.keys); 1: no shards
    shards: Annotated[int, msgspec.Meta(ge=1, le=d.MAX_SHARDS)] = 1

    def __post_init__(self) -> None:
        if self.heartbeat_s * 1000 >= self.claim_idle_ms:
            raise ValueError(
                f"streams.heartbeat_s ({self.heartbeat_s} s) must be shorter than "
                f"streams.claim_idle_ms ({self.claim_idle_ms} ms), or live workers' entries "
                "are claimed from them"
            )


class AdmissionConfig(_Cfg, kw_only=True):
    """The producer's gate (``[admission]``; see ``producer.LearnerAdmission``)."""

    # at most this fraction of what the learner consumes may be dropped (stale, zero-variance,
    # failed) and still let the producer push more; 1.0 lets every drop settle (no budget)
    max_drop_fraction: Fraction = d.ADMISSION_MAX_DROP_FRACTION
    # wait while Redis used_memory is at or above this many MiB (0: only maxmemory's limit)
    redis_memory_mb: NonNegative = d.ADMISSION_REDIS_MEMORY_MB
    # held on the drop budget with an empty pipeline: one probe push this often (0: never)
    drop_probe_s: NonNegative = d.ADMISSION_DROP_PROBE_S


class TripwireConfig(_Cfg, kw_only=True):
    """One environment's reward-hacking tripwires (``[envs.tripwires]``;
    ``streamrl.producer.tripwires``). Each compares the environment's first ``window`` scored
    samples with its latest ``window``; a tripwire that fires is logged and shown in ``streamrl
    status``, and pauses the environment's prompts when ``pause`` is set (``streamrl mix
    --resume NAME`` lifts it): off by default, so a false alarm costs no training."""

    enabled: bool = True
    pause: bool = False
    window: AtLeastOne = d.TRIPWIRE_WINDOW
    # reward up by at least this much while completion tokens or tool calls fell to at most
    # `collapse` of what they were
    reward_rise: Positive = d.TRIPWIRE_REWARD_RISE
    collapse: Fraction = d.TRIPWIRE_COLLAPSE
    # at least this share of the latest rewarded answers restate the prompt (0: off)
    restate: Fraction = d.TRIPWIRE_RESTATE
    # one prompt in `canary_every` is a canary: one of `canaries` fixed prompts (generators
    # only; 0: none); it fires when their mean reward moves by more than `canary_shift` from
    # `canary_reward` (or from the first window's)
    canary_every: Annotated[int, msgspec.Meta(ge=0)] = 0
    canaries: AtLeastOne = d.TRIPWIRE_CANARIES
    canary_shift: Positive = d.TRIPWIRE_CANARY_SHIFT
    canary_reward: float | None = None
    # a judge combined with programmatic checks (the verifier's "judge" component and the
    # others, or those named in `disagree_with`): at least `disagree` of the latest judged
    # samples have the judge further than `disagree_by` from a check (0: off)
    disagree: Fraction = d.TRIPWIRE_DISAGREE
    disagree_by: Fraction = d.TRIPWIRE_DISAGREE_BY
    disagree_with: list[str] = msgspec.field(default_factory=list)


class EnvEntry(_Cfg, kw_only=True):
    """One environment of a weighted mixture (a ``[[envs]]`` table). Tasks carry ``name``;
    the workers look it up here to build ``env`` with ``env_options`` and score it with
    ``verifier`` (the run's own ``verifier`` when empty, else the environment's)."""

    name: str = ""  # default: env
    env: str
    weight: NonNegative = 1.0
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    verifier: str | list[str] = msgspec.field(default_factory=list)
    reward_weights: list[float] = msgspec.field(default_factory=list)
    dataset: str = ""  # rows (JSONL, Parquet, ...) instead of the environment's generator
    # set by `streamrl mix --remove`: drawn no more, still known to the workers so what is
    # already queued drains
    removed: bool = False
    tripwires: TripwireConfig = msgspec.field(default_factory=TripwireConfig)

    def __post_init__(self) -> None:
        self.name = self.name or self.env
        if not re.fullmatch(r"[A-Za-z0-9_.:/-]+", self.name):
            raise ValueError(f"envs: name {self.name!r} may hold only letters, digits and _.:/-")
        if isinstance(self.verifier, str):
            self.verifier = [self.verifier] if self.verifier else []
        if self.reward_weights and len(self.reward_weights) != len(self.verifier):
            raise ValueError(
                f"envs {self.name!r}: reward_weights has {len(self.reward_weights)} values for "
                f"{len(self.verifier)} reward functions"
            )

    @property
    def live(self) -> bool:
        """Drawn from (weight above 0 and not removed)."""
        return self.weight > 0 and not self.removed


class Mixture(_Cfg, kw_only=True):
    """The run's environments and weights, at ``srl:{run}:mix``: written from the config's
    ``[[envs]]`` by the first producer, changed by ``streamrl mix`` while the run goes on
    (``version`` counts the changes); the producer and the workers re-read it."""

    v: int = d.SCHEMA_VERSION
    version: int = 0
    envs: list[EnvEntry] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"envs: the names {', '.join(dup)} are used twice (give name =)")

    def entry(self, name: str) -> EnvEntry | None:
        return next((e for e in self.envs if e.name == name), None)


class RunConfig(_Cfg, kw_only=True):
    """Everything a worker needs to know about a run; lives at ``srl:{run}:config``."""

    v: int = d.SCHEMA_VERSION
    run: RunName = d.DEFAULT_RUN
    env: str = "counter"
    group_size: AtLeastOne = 4
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    verify: VerifyConfig = msgspec.field(default_factory=VerifyConfig)
    streams: StreamConfig = msgspec.field(default_factory=StreamConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    # TRL-style reward functions that score the run instead of the environment's own verifier
    # ("module:function", or a list of them), weighted as TRL's reward_weights (default: 1
    # each); see streamrl.verifiers.reward_functions.
    verifier: str | list[str] = msgspec.field(default_factory=list)
    reward_weights: list[float] = msgspec.field(default_factory=list)
    # A weighted mixture ([[envs]] tables), instead of `env`: each prompt's environment is
    # drawn by weight (streamrl.producer.mixture); empty: every prompt is `env`'s.
    envs: list[EnvEntry] = msgspec.field(default_factory=list)
    # The LLM judge that the name "judge" in verifier stands for
    judge: JudgeConfig | None = None
    # The [learner] table, validated by the learner itself (streamrl.learner.config.
    # LearnerConfig): importing it here would pull torch into every worker.
    learner: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.verifier, str):
            self.verifier = [self.verifier] if self.verifier else []
        if self.reward_weights and len(self.reward_weights) != len(self.verifier):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for "
                f"{len(self.verifier)} reward functions in verifier"
            )
        if self.envs:
            Mixture(envs=self.envs)  # the names are unique
            if self.env_options:
                raise ValueError("with [[envs]], give env_options in each [[envs]] table")
            if not any(e.live for e in self.envs):
                raise ValueError("envs: every weight is 0; give one environment a weight")
        names = [*self.reward_functions]
        for e in self.envs:  # an [[envs]] entry's verifier may name the run's judge too
            names += [e.verifier] if isinstance(e.verifier, str) else list(e.verifier)
        if (JUDGE in names) != (self.judge is not None):
            raise ValueError(
                'verifier "judge" needs a [judge] table (base_url, model, prompt)'
                if self.judge is None
                else 'a [judge] table is used only with verifier = "judge" (or a list holding it)'
            )

    def mixture(self) -> Mixture:
        """The run's environments as a mixture: its ``[[envs]]``, or ``env`` alone."""
        if self.envs:
            return Mixture(envs=list(self.envs))
        return Mixture(envs=[EnvEntry(env=self.env, env_options=self.env_options)])

    @property
    def reward_functions(self) -> list[str]:
        """``verifier`` as a list (a TOML file may give one string)."""
        return [self.verifier] if isinstance(self.verifier, str) else list(self.verifier)


RUN_CONFIG = msgspec.msgpack.Decoder(RunConfig)
MIXTURE = msgspec.msgpack.Decoder(Mixture)


def load_toml(path: str | Path, type_: type[msgspec.Struct] = RunConfig) -> Any:
    """Decode a TOML file into ``type_``; unknown keys are errors, not silently ignored."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e}") from None
