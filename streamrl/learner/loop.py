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
``streamrl.bus.health``), the learner checkpoints what it has and stops with ``RunFaulted``: one
line with the reason, exit status 1 from ``streamrl learn``.

Shards. A sharded run (``[streams] shards``) has one ``groups`` stream per shard; the learner
reads all of them, a shard at a time in turn, and every entry is known by (shard, id). The
checkpoint records the newest covered entry of each shard (``last_ids``), acks go to each
entry's own shard, and a restart re-reads each shard's pending entries, skipping what its
shard's ``last_ids`` covers: every group still affects the weights exactly once. (The order
of entries from different shards depends on arrival, so a restarted sharded learner is
exactly-once but not bitwise-equal to an uninterrupted one.)

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
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis
import structlog
import torch

from streamrl import schema
from streamrl.bus import health
from streamrl.bus.keys import Keys, shard_keys
from streamrl.bus.streams import ensure_groups
from streamrl.bus.values import as_str, id_order
from streamrl.connection import connect
from streamrl.defaults import LEARNER_GROUP, SHARD_BLOCK_MS
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
from streamrl.learner.config import LearnerConfig
from streamrl.learner.distributed import DataParallel, Trainer, follow, world_size, wrap
from streamrl.learner.losses import adapt_entropy_coef
from streamrl.learner.model import (
    AdapterDisabled,
    load_model,
    load_reference,
    seed_everything,
)
from streamrl.learner.report import (
    Reporters,
    make_reporters,
    step_scalars,
)
from streamrl.learner.train import StepStats, make_optimizer, train_step
from streamrl.workers.context import read_config

log = structlog.get_logger("streamrl.learner")


Ref = tuple[int, str]  # (shard index, entry id): one entry of one shard's groups stream


@dataclass
class Window:
    """Entries read since the last step: what the next step will commit."""

    ids: list[Ref] = field(default_factory=list)
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
    unacked: list[Ref] = field(default_factory=list)
    last: StepStats | None = None
    group_size: int = 0  # from the run config; sets the admission limit the producer obeys
    shards: list[Keys] = field(default_factory=list)  # every shard's keys; [keys] unsharded
    last_taken: dict[int, str] = field(default_factory=dict)  # per shard: newest id taken
    _turn: int = 0  # the shard read first next time (round robin)
    trainer: Trainer | None = None  # data parallel: rank 0 sends each step to every rank
    rank_pids: list[int] = field(default_factory=list)

    reporters: Reporters = field(default_factory=lambda: Reporters([]))
    last_step_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.shards:
            self.shards = [self.keys]

    @property
    def consumer(self) -> str:
        return self.cfg.consumer

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def covered(self, shard: int) -> str:
        """The newest entry of ``shard`` whose effect the checkpointed state holds."""
        if not self.sharded:
            return self.state.last_id
        return self.state.last_ids.get(self.shards[shard].label, "0-0")

    # -- reading
    def read_shard(self, shard: int, start: str, block_ms: int | None) -> list[tuple]:
        resp = self.r.xreadgroup(
            LEARNER_GROUP,
            self.consumer,
            {self.shards[shard].groups: start},
            count=self.cfg.read_count,
            block=block_ms,
        )
        return [
            (shard, as_str(eid), fields)
            for _stream, entries in resp or ()
            for eid, fields in entries
        ]

    def read(self, start: str, block_ms: int | None) -> list[tuple]:
        """New entries, (shard, id, fields). Several shards are read in turn without
        blocking; only when all are empty does the learner block, on one shard and for at
        most ``SHARD_BLOCK_MS``, so no shard waits long behind another."""
        if not self.sharded:
            return self.read_shard(0, start, block_ms)
        n = len(self.shards)
        for j in range(n):
            shard = (self._turn + j) % n
            rows = self.read_shard(shard, start, None)
            if rows:
                self._turn = (shard + 1) % n
                return rows
        shard, self._turn = self._turn, (self._turn + 1) % n
        block = block_ms if block_ms is None else min(block_ms, SHARD_BLOCK_MS)
        return self.read_shard(shard, start, block)

    def read_pending(self) -> list[tuple]:
        """This consumer's delivered-but-unacked entries, oldest first in each shard."""
        out: list[tuple] = []
        for shard in range(len(self.shards)):
            start = "0"
            while True:
                rows = self.read_shard(shard, start, None)
                if not rows:
                    break
                out.extend(rows)
                start = rows[-1][1]
        return out

    def read_lost(self) -> list[tuple]:
        """Entries delivered to us that we never saw. redis-py re-sends a command after a
        dropped connection (a Redis restart); if the first XREADGROUP had been served, its
        entries sit in our pending list, newer than anything taken, until we read them."""
        out: list[tuple] = []
        for shard in range(len(self.shards)):
            out += self.read_shard(shard, self.last_taken.get(shard, "0-0"), None)
        return out

    # -- one entry
    def take(self, shard: int, entry_id: str, fields: dict | None) -> None:
        """Decide about one entry: accept into the batch, or drop and count."""
        w = self.window
        self.last_taken[shard] = entry_id
        w.ids.append((shard, entry_id))
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
        coef = cfg.entropy_coef if st.entropy_coef is None else st.entropy_coef
        step_cfg = msgspec.structs.replace(cfg, entropy_coef=coef)  # this step's coefficient
        if self.trainer is not None:
            stats = self.trainer.step(w.groups, self.optimizer, step_cfg, st.step, self.ref_model)
        else:
            batch = make_batch(w.groups, self.tokenizer.pad_token_id, cfg.scale_rewards)
            stats = train_step(self.model, self.optimizer, batch, step_cfg, st.step, self.ref_model)
        if cfg.entropy_target is not None:
            st.entropy_coef = adapt_entropy_coef(
                coef, stats.entropy, cfg.entropy_target, cfg.entropy_coef_step,
                cfg.entropy_coef_max,
            )  # fmt: skip
        w.counters.groups_applied += len(w.groups)
        w.counters.tokens_trained += stats.tokens
        w.counters.is_tokens += stats.is_tokens
        w.counters.is_clipped += stats.is_clipped
        st.counters.add(w.counters)
        if self.sharded:
            for shard, entry_id in w.ids:  # in each shard, ids were taken in order
                st.last_ids[self.shards[shard].label] = entry_id
        else:
            st.last_id = w.ids[-1][1]
        st.step += 1
        st.reward_mean = stats.reward_mean
        st.loss = stats.loss
        self.unacked.extend(w.ids)
        consumed, drops = w.counters.groups_consumed, w.counters.drop_fractions()
        now = time.monotonic()
        scalars = step_scalars(stats, w.counters.staleness, now - self.last_step_at)
        scalars["train/entropy_coef"] = coef
        self.last_step_at = now
        self.window = Window()
        self.last = stats
        if st.step % cfg.logging_steps == 0:
            log.info(
                "step", step=st.step, loss=round(stats.loss, 6), reward_mean=stats.reward_mean,
                entropy=round(stats.entropy, 4), entropy_coef=round(coef, 6),
                grad_norm=round(stats.grad_norm, 4), lr=stats.lr, tokens=stats.tokens,
                groups_consumed=consumed, dropped={k: v for k, v in drops.items() if v},
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

    def ack(self, refs: list[Ref]) -> None:
        for shard in sorted({s for s, _ in refs}):
            ids = [i for s, i in refs if s == shard]
            for j in range(0, len(ids), 1000):
                self.r.xack(self.shards[shard].groups, LEARNER_GROUP, *ids[j : j + 1000])

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
            "shards": len(self.shards),
            "last_checkpoint_step": st.checkpoint_step,
            "last_checkpoint_time": st.checkpoint_time,
            "reward_mean": st.reward_mean,
            "loss": st.loss,
            "updated_at": time.time(),
        }
        if self.last is not None:
            fields.update(lr=self.last.lr, grad_norm=self.last.grad_norm)
            fields["entropy"] = round(self.last.entropy, 4)
        coef = self.cfg.entropy_coef if st.entropy_coef is None else st.entropy_coef
        fields["entropy_coef"] = round(coef, 6)
        for reason, frac in c.drop_fractions().items():
            fields[f"dropped_fraction_{reason}"] = frac
        if self.sharded:
            fields["last_ids"] = msgspec.json.encode(st.last_ids).decode()
        if self.rank_pids:
            fields["ranks"] = len(self.rank_pids)
            fields["rank_pids"] = ",".join(map(str, self.rank_pids))
        if self.group_size:
            # admission control: rollouts may run (max_staleness + 1) batches ahead, no more
            batch = self.cfg.batch_groups * self.group_size
            fields["max_in_flight"] = (self.cfg.max_staleness + 1) * batch
        self.r.hset(self.keys.learner, mapping=fields)

    def done(self) -> bool:
        return bool(self.cfg.total_steps) and self.state.step >= self.cfg.total_steps


def _shards(r: redis.Redis, run: str, shards: int | None) -> list[Keys]:
    """The run's shards: its stored config's count, else ``shards``, else 1."""
    stored = read_config(r.get(Keys(run).config))
    if stored is not None:
        if shards is not None and shards != stored.streams.shards:
            raise ValueError(
                f"run {run!r} has {stored.streams.shards} shards, but the learner was told "
                f"{shards}: [streams] shards must match the producer's"
            )
        return shard_keys(run, stored.streams.shards)
    return shard_keys(run, shards or 1)


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
    shards: int | None = None,
) -> LearnerState:
    """Train until ``total_steps`` (if set), until ``stop`` is set (SIGTERM/SIGINT set it in
    the main thread), or until no group arrived for ``exit_when_idle`` seconds. Returns the
    final state; the last step is checkpointed and acked on the way out. Raises
    ``health.RunFaulted`` (after that checkpoint) when the run's fault key is set.
    ``shards``: the run's shard count when no producer has stored its config yet (else the
    stored config's, which must agree)."""
    cfg = config
    stop = stop or threading.Event()
    dp = DataParallel.init(cfg) if world_size() > 1 else None
    if dp is not None:
        cfg = msgspec.structs.replace(cfg, device=str(dp.device))
    if dp is None or dp.leader:
        _stop_on_signals(stop)  # other ranks die of SIGTERM: rank 0 stops them with a command
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    structlog.contextvars.bind_contextvars(
        run=run,
        role="learner",
        worker=f"{socket.gethostname()}-{os.getpid()}",
        **({"rank": dp.rank} if dp else {}),
    )
    seed_everything(cfg.seed)
    out = cfg.out_dir(run)
    if dp is not None and not dp.leader:
        return _follower(dp, cfg)
    r = connect(url, resilient=True)
    keys = Keys(run)
    health.check_fault(r, keys)  # before loading anything
    shard_list = _shards(r, run, shards)
    for one in shard_list:
        ensure_groups(r, one)

    model, tokenizer, device = load_model(cfg)
    ref_model = None
    if cfg.beta != 0.0:
        ref_model = AdapterDisabled(model) if cfg.lora_r > 0 else load_reference(cfg, device)
    optimizer = make_optimizer(model, cfg)
    ckpt_dir = out / "checkpoints"
    clean_temporaries(ckpt_dir)
    path = latest_checkpoint(ckpt_dir)
    if dp is not None:
        dp.broadcast_text(str(path) if path else "")  # every rank restores the same one
    state = restore_checkpoint(path, model, optimizer) if path else LearnerState()
    lrn = Learner(
        r, keys, cfg, out, model, tokenizer, optimizer, ref_model, state, shards=shard_list
    )
    if dp is not None:
        lrn.trainer = Trainer(dp, wrap(model, dp), tokenizer.pad_token_id)
        lrn.rank_pids = dp.gather_pids()
    structlog.contextvars.bind_contextvars(policy_version=state.policy_version)
    lrn.reporters = make_reporters(cfg.report_to, out, run, msgspec.structs.asdict(cfg))
    run_config = read_config(r.get(keys.config))
    lrn.group_size = run_config.group_size if run_config else 0
    log.info("learner started", step=state.step, restored=str(path) if path else None)
    if path is None:
        lrn.publish()  # v0: the initial weights, so every backend starts from the same thing

    # Entries delivered to us before a crash: skip what the checkpoint covers, redo the rest.
    for shard, entry_id, fields in lrn.read_pending():
        if id_order(entry_id) <= id_order(lrn.covered(shard)):
            lrn.ack([(shard, entry_id)])
        elif not lrn.done():
            lrn.take(shard, entry_id, fields)
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
        for shard, entry_id, fields in rows:
            if lrn.done():
                break  # left pending: a later learner with a larger total_steps takes them
            lrn.take(shard, entry_id, fields)
        lrn.report()
        if lrn.trainer is not None:
            lrn.trainer.heartbeat()  # a dead rank shows up here, even while no group comes
        if exit_when_idle is not None and time.monotonic() - idle_since > exit_when_idle:
            break

    if state.step > state.checkpoint_step:
        lrn.checkpoint()
    lrn.reporters.close()
    if lrn.trainer is not None and dp is not None:
        lrn.trainer.stop()
        dp.close()
    lrn.report(status="stopped" if fault is None else "faulted")
    log.info("learner stopped", step=state.step, **msgspec.structs.asdict(state.counters))
    with contextlib.suppress(redis.RedisError):
        r.close()
    if fault is not None:
        raise health.RunFaulted(health.one_line(fault))
    return state


def _follower(dp: DataParallel, cfg: LearnerConfig) -> LearnerState:
    """Ranks > 0: the same model, optimizer and checkpoint as rank 0, then its steps."""
    model, tokenizer, device = load_model(cfg)
    ref_model = None
    if cfg.beta != 0.0:
        ref_model = AdapterDisabled(model) if cfg.lora_r > 0 else load_reference(cfg, device)
    optimizer = make_optimizer(model, cfg)
    path = dp.broadcast_text(None)
    state = restore_checkpoint(Path(path), model, optimizer) if path else LearnerState()
    ddp = wrap(model, dp)
    dp.gather_pids()
    log.info("rank started", rank=dp.rank, world=dp.world, restored=path or None)
    state.step += follow(dp, ddp, optimizer, cfg, tokenizer.pad_token_id, ref_model)
    log.info("rank stopped", rank=dp.rank, step=state.step)
    dp.close()
    return state
