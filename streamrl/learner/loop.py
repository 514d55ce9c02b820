"""The learner process: ``streamrl learn --config configs/<name>.toml``.

    read groups (consumer group ``learner``) ─▶ drop stale / zero-variance ─▶ batch of
    ``batch_groups`` ─▶ optimizer step ─▶ every ``sync_every``: publish weights
                                      └──▶ every ``checkpoint_every``: checkpoint, then XACK

Exactly once. The learner XACKs a ``groups`` entry only after a checkpoint whose weights
contain its effect (applied, or dropped and counted). The checkpoint records ``last_id``,
the newest such entry. A restarted learner restores the newest checkpoint and first re-reads
its own pending entries (XREADGROUP from ``0``, same consumer name): those up to ``last_id``
are acked and skipped, the rest are processed again, in the same order as the first time.
Training is deterministic given the checkpoint and that order (seeded, one fixed code path),
so a learner killed at any moment and restarted ends with bitwise the same weights.

Faults. When the run's fault key is set (a rollout worker stuck on an old policy, see
``streamrl.health``), the learner checkpoints what it has and stops with ``RunFaulted``: one
line with the reason, exit status 1 from ``streamrl learn``.

A step's decisions are all taken when its batch completes: the entries read since the
previous step (accepted or dropped) are folded into the state together, so a checkpoint
never covers an accepted group that is still waiting for its batch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import click
import msgspec
import redis
import structlog
import torch
from click.core import ParameterSource

from streamrl import health, schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.connection import check_url, connect, redact, resolve_url
from streamrl.defaults import DEFAULT_RUN, LEARNER_GROUP, RUN_DIR
from streamrl.learner import publish
from streamrl.learner._failpoints import failpoint
from streamrl.learner.batch import has_tokens, is_zero_variance, make_batch, staleness
from streamrl.learner.checkpoint import (
    Counters,
    LearnerState,
    clean_temporaries,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from streamrl.learner.config import LearnerConfig, load_learner_config
from streamrl.learner.model import (
    AdapterDisabled,
    load_model,
    load_reference,
    seed_everything,
)
from streamrl.learner.report import (
    Reporters,
    ReportUnavailable,
    check_available,
    make_reporters,
    step_scalars,
)
from streamrl.learner.train import StepStats, make_optimizer, train_step
from streamrl.models.local import ModelNotFound, require_model_dir
from streamrl.workers.context import read_config

log = structlog.get_logger("streamrl.learner")


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _s(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


@dataclass
class Window:
    """Entries read since the last step: what the next step will commit."""

    ids: list[str] = field(default_factory=list)
    groups: list[schema.Group] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)


@dataclass
class Learner:
    r: redis.Redis
    keys: Keys
    cfg: LearnerConfig
    out: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    state: LearnerState
    window: Window = field(default_factory=Window)
    unacked: list[str] = field(default_factory=list)
    last: StepStats | None = None
    last_taken: str = "0-0"  # the newest entry id handed to take()
    group_size: int = 0  # from the run config; sets the admission limit the producer obeys
    reporters: Reporters = field(default_factory=lambda: Reporters([]))
    last_step_at: float = field(default_factory=time.monotonic)

    @property
    def consumer(self) -> str:
        return self.cfg.consumer

    # -- reading
    def read(self, start: str, block_ms: int | None) -> list[tuple[str, dict]]:
        resp = self.r.xreadgroup(
            LEARNER_GROUP,
            self.consumer,
            {self.keys.groups: start},
            count=self.cfg.read_count,
            block=block_ms,
        )
        return [(_s(eid), fields) for _stream, entries in resp or () for eid, fields in entries]

    def read_pending(self) -> list[tuple[str, dict]]:
        """This consumer's delivered-but-unacked entries, oldest first."""
        out: list[tuple[str, dict]] = []
        start = "0"
        while True:
            rows = self.read(start, None)
            if not rows:
                return out
            out.extend(rows)
            start = rows[-1][0]

    def read_lost(self) -> list[tuple[str, dict]]:
        """Entries delivered to us that we never saw. redis-py re-sends a command after a
        dropped connection (a Redis restart); if the first XREADGROUP had been served, its
        entries sit in our pending list, newer than anything taken, until we read them."""
        return self.read(self.last_taken, None)

    # -- one entry
    def take(self, entry_id: str, fields: dict | None) -> None:
        """Decide about one entry: accept into the batch, or drop and count."""
        w = self.window
        self.last_taken = entry_id
        w.ids.append(entry_id)
        w.counters.groups_consumed += 1
        try:
            group = schema.check_version(schema.GROUP.decode((fields or {})[b"p"]))
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as e:
            w.counters.dropped_invalid += 1
            log.warning("invalid group entry", entry_id=entry_id, error=str(e))
            return
        w.counters.samples_consumed += len(group.samples)
        if not has_tokens(group):
            w.counters.dropped_no_tokens += 1
        elif is_zero_variance(group):
            w.counters.dropped_zero_variance += 1
        elif (behind := staleness(group, self.state.policy_version)) > self.cfg.max_staleness:
            w.counters.dropped_stale += 1
        else:
            w.counters.staleness[str(behind)] = w.counters.staleness.get(str(behind), 0) + 1
            w.groups.append(group)
            if len(w.groups) == self.cfg.batch_groups:
                self.step()

    # -- one optimizer step
    def step(self) -> None:
        w, st, cfg = self.window, self.state, self.cfg
        batch = make_batch(w.groups, self.tokenizer.pad_token_id, cfg.scale_rewards)
        stats = train_step(self.model, self.optimizer, batch, cfg, st.step, self.ref_model)
        w.counters.groups_applied += len(w.groups)
        w.counters.tokens_trained += stats.tokens
        w.counters.is_tokens += stats.is_tokens
        w.counters.is_clipped += stats.is_clipped
        st.counters.add(w.counters)
        st.last_id = w.ids[-1]
        st.step += 1
        st.reward_mean = stats.reward_mean
        st.loss = stats.loss
        self.unacked.extend(w.ids)
        consumed, drops = w.counters.groups_consumed, w.counters.drop_fractions()
        now = time.monotonic()
        scalars = step_scalars(stats, w.counters.staleness, now - self.last_step_at)
        self.last_step_at = now
        self.window = Window()
        self.last = stats
        if st.step % cfg.logging_steps == 0:
            log.info(
                "step", step=st.step, loss=round(stats.loss, 6), reward_mean=stats.reward_mean,
                entropy=round(stats.entropy, 4), grad_norm=round(stats.grad_norm, 4),
                lr=stats.lr, tokens=stats.tokens, groups_consumed=consumed,
                dropped={k: v for k, v in drops.items() if v},
            )  # fmt: skip
        self.reporters.log(st.step, scalars)
        if st.step % cfg.sync_every == 0:
            st.policy_version += 1
            self.publish()
        if st.step % cfg.checkpoint_every == 0:
            self.checkpoint()
        self.report()

    def publish(self) -> None:
        pv = publish.publish(
            self.r,
            self.keys,
            self.model,
            self.tokenizer,
            self.out / "policy",
            self.state.policy_version,
            self.state.step,
            lora=self.cfg.lora_r > 0,
            keep=self.cfg.keep_policy_versions,
        )
        structlog.contextvars.bind_contextvars(policy_version=pv.version)
        due = pv.version == 0 or self.state.step % self.cfg.logging_steps == 0
        (log.info if due else log.debug)("published", step=pv.step, path=pv.path)

    def checkpoint(self) -> None:
        """Checkpoint, and only then XACK what it covers."""
        st = self.state
        st.checkpoint_step, st.checkpoint_time = st.step, time.time()
        path = save_checkpoint(
            self.out / "checkpoints", st, self.model, self.optimizer, self.cfg.keep_checkpoints
        )
        failpoint("after_checkpoint", st.step)
        self.ack(self.unacked)
        self.unacked = []
        log.info("checkpoint", step=st.step, path=str(path), last_id=st.last_id)

    def ack(self, ids: list[str]) -> None:
        for i in range(0, len(ids), 1000):
            self.r.xack(self.keys.groups, LEARNER_GROUP, *ids[i : i + 1000])

    def report(self, status: str = "running") -> None:
        """Progress for ``streamrl status``: committed counters plus the open window."""
        st, c = self.state, Counters()
        c.add(st.counters)
        c.add(self.window.counters)
        fields: dict[str, str | int | float] = {
            "status": status,
            "pid": os.getpid(),
            "step": st.step,
            "policy_version": st.policy_version,
            **{k: v for k, v in msgspec.structs.asdict(c).items() if not isinstance(v, dict)},
            "applied_staleness": msgspec.json.encode(c.staleness).decode(),
            "is_clipped_fraction": round(c.is_clipped / max(1, c.is_tokens), 4),
            "waiting_groups": len(self.window.groups),
            "last_id": st.last_id,
            "last_checkpoint_step": st.checkpoint_step,
            "last_checkpoint_time": st.checkpoint_time,
            "reward_mean": st.reward_mean,
            "loss": st.loss,
            "updated_at": time.time(),
        }
        if self.last is not None:
            fields.update(lr=self.last.lr, grad_norm=self.last.grad_norm)
            fields["entropy"] = round(self.last.entropy, 4)
        for reason, frac in c.drop_fractions().items():
            fields[f"dropped_fraction_{reason}"] = frac
        if self.group_size:
            # admission control: rollouts may run (max_staleness + 1) batches ahead, no more
            batch = self.cfg.batch_groups * self.group_size
            fields["max_in_flight"] = (self.cfg.max_staleness + 1) * batch
        self.r.hset(self.keys.learner, mapping=fields)

    def done(self) -> bool:
        return bool(self.cfg.total_steps) and self.state.step >= self.cfg.total_steps


def _stop_on_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def run_learner(
    url: str,
    run: str,
    config: LearnerConfig,
    *,
    exit_when_idle: float | None = None,
    stop: threading.Event | None = None,
) -> LearnerState:
    """Train until ``total_steps`` (if set), until ``stop`` is set (SIGTERM/SIGINT set it in
    the main thread), or until no group arrived for ``exit_when_idle`` seconds. Returns the
    final state; the last step is checkpointed and acked on the way out. Raises
    ``health.RunFaulted`` (after that checkpoint) when the run's fault key is set."""
    cfg = config
    stop = stop or threading.Event()
    _stop_on_signals(stop)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    structlog.contextvars.bind_contextvars(
        run=run, role="learner", worker=f"{socket.gethostname()}-{os.getpid()}"
    )
    seed_everything(cfg.seed)
    out = cfg.out_dir(run)
    r = connect(url, resilient=True)
    keys = Keys(run)
    health.check_fault(r, keys)  # before loading anything
    ensure_groups(r, keys)

    model, tokenizer, device = load_model(cfg)
    ref_model = None
    if cfg.beta != 0.0:
        ref_model = AdapterDisabled(model) if cfg.lora_r > 0 else load_reference(cfg, device)
    optimizer = make_optimizer(model, cfg)
    ckpt_dir = out / "checkpoints"
    clean_temporaries(ckpt_dir)
    path = latest_checkpoint(ckpt_dir)
    state = restore_checkpoint(path, model, optimizer) if path else LearnerState()
    lrn = Learner(r, keys, cfg, out, model, tokenizer, optimizer, ref_model, state)
    structlog.contextvars.bind_contextvars(policy_version=state.policy_version)
    lrn.reporters = make_reporters(cfg.report_to, out, run, msgspec.structs.asdict(cfg))
    run_config = read_config(r.get(keys.config))
    lrn.group_size = run_config.group_size if run_config else 0
    log.info("learner started", step=state.step, restored=str(path) if path else None)
    if path is None:
        lrn.publish()  # v0: the initial weights, so every backend starts from the same thing

    # Entries delivered to us before a crash: skip what the checkpoint covers, redo the rest.
    covered = id_key(state.last_id)
    for entry_id, fields in lrn.read_pending():
        if id_key(entry_id) <= covered:
            lrn.ack([entry_id])
        elif not lrn.done():
            lrn.take(entry_id, fields)
    lrn.report()

    idle_since = time.monotonic()
    fault = None
    while not stop.is_set() and not lrn.done():
        fault = health.fault(r, keys)
        if fault is not None:
            break
        rows = lrn.read(">", cfg.block_ms) or lrn.read_lost()
        if rows:
            idle_since = time.monotonic()
        for entry_id, fields in rows:
            if lrn.done():
                break  # left pending: a later learner with a larger total_steps takes them
            lrn.take(entry_id, fields)
        lrn.report()
        if exit_when_idle is not None and time.monotonic() - idle_since > exit_when_idle:
            break

    if state.step > state.checkpoint_step:
        lrn.checkpoint()
    lrn.reporters.close()
    lrn.report(status="stopped" if fault is None else "faulted")
    log.info("learner stopped", step=state.step, **msgspec.structs.asdict(state.counters))
    with contextlib.suppress(redis.RedisError):
        r.close()
    if fault is not None:
        raise health.RunFaulted(health.one_line(fault))
    return state


@click.command("learn")
@click.option(
    "--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--redis", "url", envvar="STREAMRL_REDIS_URL", help="Redis URL of the run.")
@click.option(
    "--run", default=None, envvar="STREAMRL_RUN", help="Default: the config's `run`, else default."
)
@click.option("--model", default=None, help="Override [learner].model.")
@click.option("--output-dir", default=None, help="Override [learner].output_dir.")
@click.option("--device", default=None, help="Override [learner].device (auto|cpu|cuda).")
@click.option("--total-steps", type=int, default=None, help="Override [learner].total_steps.")
@click.option(
    "--exit-when-idle",
    type=float,
    default=None,
    help="Exit after this many seconds without a new group (batch jobs, tests).",
)
def learn_command(
    config_path: str,
    url: str | None,
    run: str | None,
    model: str | None,
    output_dir: str | None,
    device: str | None,
    total_steps: int | None,
    exit_when_idle: float | None,
) -> None:
    """Train the policy on the run's groups (GRPO family), publish weights, checkpoint."""
    cfg = load_learner_config(
        config_path, model=model, output_dir=output_dir, device=device, total_steps=total_steps
    )
    # `streamrl --redis URL --run R learn ...`: the group's options count as well as our own
    root = click.get_current_context().find_root()
    url = url or root.params.get("redis_url")
    if run is None and root.get_parameter_source("run") not in (None, ParameterSource.DEFAULT):
        run = root.params["run"]
    resolved = resolve_url(url, root.params.get("run_dir") or RUN_DIR)
    if not resolved:
        raise click.UsageError("no Redis: pass --redis URL, set STREAMRL_REDIS_URL or run `up`")
    try:
        check_url(resolved)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        require_model_dir(cfg.model, "learner.model")
        check_available(cfg.report_to)
    except (ModelNotFound, ReportUnavailable) as e:
        raise click.ClickException(str(e)) from None
    try:
        connect(resolved).ping()
    except redis.RedisError as e:
        raise click.ClickException(redact(f"cannot reach Redis at {resolved}: {e}")) from None
    if run is None:
        with open(config_path, "rb") as f:
            run = str(tomllib.load(f).get("run", DEFAULT_RUN))
    state = run_learner(resolved, run, cfg, exit_when_idle=exit_when_idle)
    click.echo(msgspec.json.encode(state).decode())


if __name__ == "__main__":
    learn_command()
