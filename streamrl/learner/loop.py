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
line with the reason, exit status 1 from ``streamrl learn``. A full disk: a policy version that
cannot be written is skipped (nothing announced), a checkpoint that cannot be written stops the
learner with ``CheckpointFailed`` (nothing acked past the last complete one).

Verdicts. Zero-variance groups are solved or have no signal (``streamrl.learner.outcomes``).
With ``stop_when_solved`` the learner stops once the task is solved: it publishes and
checkpoints what it has, logs the one-line ``LearnerState.verdict`` and returns.

Shards. A sharded run has one ``groups`` stream per shard, read in turn; see
``streamrl.learner.reader``.

A step's decisions are all taken when its batch completes: the entries read since the
previous step (accepted or dropped) are folded into the state together, so a checkpoint
never covers an accepted group that is still waiting for its batch.

Kept whole: reading, taking, stepping and committing share one exactly-once bookkeeping (what
was taken, covered and acked); split, each part would need the others' state.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis
import structlog
import torch

from streamrl import schema
from streamrl.bus import eviction, health
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.bus.values import id_order
from streamrl.connection import connect
from streamrl.learner import publish
from streamrl.learner._failpoints import failpoint
from streamrl.learner.batch import has_tokens, is_zero_variance, make_batch, staleness
from streamrl.learner.checkpoint import CheckpointFailed, Counters, LearnerState, save_checkpoint
from streamrl.learner.config import LearnerConfig
from streamrl.learner.distributed import DataParallel, Trainer, park, rank_fields
from streamrl.learner.losses import adapt_entropy_coef
from streamrl.learner.mismatch import StepLog, weights_version
from streamrl.learner.outcomes import NO_SIGNAL, SOLVED, Outcomes
from streamrl.learner.reader import GroupsReader, Ref, resolve_shards
from streamrl.learner.report import Reporters, make_reporters, step_scalars
from streamrl.learner.setup import load_training, run_follower, start_process
from streamrl.learner.train import StepStats, train_step
from streamrl.workers.context import read_config

log = structlog.get_logger("streamrl.learner")


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
    stop = stop or threading.Event()
    cfg, dp = start_process(config, run, stop)
    if dp is not None and not dp.leader:
        return run_follower(dp, cfg, run)
    lrn = _open(url, run, cfg, dp, shards)
    park(lrn, dp)  # a rank's model is torn down by exit_rank, never by a destructor here
    try:
        lrn.redo_pending()
        fault = _train(lrn, stop, exit_when_idle)
    except CheckpointFailed as e:  # a full disk: stop, acking nothing past the last checkpoint
        log.error(str(e))
        _close(lrn, dp, None, failed=True)
        raise
    _close(lrn, dp, fault)
    if fault is not None:
        raise health.RunFaulted(health.one_line(fault))
    return lrn.state


def _open(
    url: str, run: str, cfg: LearnerConfig, dp: DataParallel | None, shards: int | None
) -> _Learner:
    """Rank 0's start: the run's streams, then the model and its checkpoint; on a fresh
    start, the initial weights published as version 0."""
    r = connect(url, resilient=True)
    keys = Keys(run)
    eviction.check(r, "learner")
    health.check_fault(r, keys)  # before loading anything
    shard_list = resolve_shards(r, run, shards)
    for one in shard_list:
        ensure_groups(r, one)
    out = cfg.out_dir(run)
    t = load_training(cfg, out, dp)
    reader = GroupsReader(r, shard_list, cfg.consumer, cfg.read_count)
    lrn = _Learner(r, keys, cfg, out, reader, t.model, t.tokenizer, t.optimizer, t.ref_model,
                   t.state, ranks=t.ranks)  # fmt: skip
    if dp is not None and t.parallel is not None:
        lrn.trainer = Trainer(dp, t.parallel, t.tokenizer.pad_token_id)
    structlog.contextvars.bind_contextvars(policy_version=t.state.policy_version)
    lrn.reporters = make_reporters(cfg.report_to, out, run, msgspec.structs.asdict(cfg))
    run_config = read_config(r.get(keys.config))
    lrn.group_size = run_config.group_size if run_config else 0
    t.state.verdict = ""  # a learner restarted after a verdict trains on
    restored = str(t.restored) if t.restored else None
    log.info("learner started", step=t.state.step, restored=restored)
    if t.restored is None:
        lrn.publish()  # v0: the initial weights, so every backend starts from the same thing
    return lrn


def _train(lrn: _Learner, stop: threading.Event, exit_when_idle: float | None) -> str | None:
    """Read and train until done, stopped or idle. Returns the run's fault, if one was set."""
    idle_since = time.monotonic()
    while not stop.is_set() and not lrn.done():
        fault = health.fault(lrn.r, lrn.keys)
        if fault is not None:
            return fault
        rows = lrn.reader.read(">", lrn.cfg.block_ms) or lrn.reader.read_lost()
        if rows:
            idle_since = time.monotonic()
        for shard, entry_id, fields in rows:
            if lrn.done():
                break  # left pending: a later learner with a larger total_steps takes them
            if lrn.taken_before(shard, entry_id):
                continue
            lrn.take(shard, entry_id, fields)
        lrn.report()
        if lrn.trainer is not None:
            lrn.trainer.heartbeat()  # a dead rank shows up here, even while no group comes
        if exit_when_idle is not None and time.monotonic() - idle_since > exit_when_idle:
            break
    return None


def _close(lrn: _Learner, dp: DataParallel | None, fault: str | None, failed: bool = False):
    """Checkpoint (and ack) the last steps (unless a checkpoint ``failed``), stop the other
    ranks, say why we stopped."""
    st = lrn.state
    if st.verdict and st.step % lrn.cfg.sync_every and not failed:  # the last steps' weights
        st.policy_version += 1
        lrn.publish()
    if st.step > st.checkpoint_step and not failed:
        lrn.checkpoint()
    lrn.reporters.close()
    if lrn.trainer is not None and dp is not None:
        lrn.trainer.stop()
    status = "faulted" if fault else "failed" if failed else "solved" if st.verdict else "stopped"
    lrn.report(status=status)
    log.info("learner stopped", step=st.step, **msgspec.structs.asdict(st.counters))
    if st.verdict:
        log.info(st.verdict)
    with contextlib.suppress(redis.RedisError):
        lrn.r.close()


@dataclass
class _Window:
    """Entries read since the last step: what the next step will commit."""

    ids: list[Ref] = field(default_factory=list)
    groups: list[schema.Group] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)


@dataclass
class _Learner:
    """Rank 0: what it has read, what it trains, and what it has committed."""

    r: redis.Redis
    keys: Keys
    cfg: LearnerConfig
    out: Path
    reader: GroupsReader
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    state: LearnerState
    window: _Window = field(default_factory=_Window)
    unacked: list[Ref] = field(default_factory=list)
    steps: StepLog = field(default_factory=StepLog)  # the last step's figures, for report()
    group_size: int = 0  # from the run config; sets the admission limit the producer obeys
    trainer: Trainer | None = None  # data parallel: rank 0 sends each step to every rank
    ranks: list[tuple[int, int]] = field(default_factory=list)  # (pid, parameter elements held)
    reporters: Reporters = field(default_factory=lambda: Reporters([]))
    last_step_at: float = field(default_factory=time.monotonic)
    publisher: publish.Publisher = field(default_factory=publish.Publisher)
    outcomes: Outcomes = field(init=False)  # solved / no signal over the last groups

    def __post_init__(self) -> None:
        self.outcomes = Outcomes.for_run(self.cfg, self.r, self.keys.run)

    def covered(self, shard: int) -> str:
        """The newest entry of ``shard`` whose effect the checkpointed state holds."""
        if not self.reader.sharded:
            return self.state.last_id
        return self.state.last_ids.get(self.reader.shards[shard].label, "0-0")

    def done(self) -> bool:
        """``total_steps`` reached, or the task solved (``stop_when_solved``)."""
        st, total = self.state, self.cfg.total_steps
        return bool(st.verdict) or (bool(total) and st.step >= total)

    def entropy_coef(self) -> float:
        """This step's entropy coefficient: the adapted one, else the configured one."""
        coef = self.state.entropy_coef
        return self.cfg.entropy_coef if coef is None else coef

    def redo_pending(self) -> None:
        """Entries delivered to us before a crash: skip what the checkpoint covers; redo it."""
        for shard, entry_id, fields in self.reader.read_pending():
            if id_order(entry_id) <= id_order(self.covered(shard)):
                self.reader.ack([(shard, entry_id)])
            elif not self.done():
                self.take(shard, entry_id, fields)
        self.report()

    def taken_before(self, shard: int, entry_id: str) -> bool:
        """Taken already: a Cluster failover can lose the group's last-delivered id, and
        ``XREADGROUP >`` hands entries out again. Skipped; acked if the checkpoint covers it."""
        taken = self.reader.last_taken.get(shard)
        if taken is None or id_order(entry_id) > id_order(taken):
            return False
        if id_order(entry_id) <= id_order(self.covered(shard)):
            self.reader.ack([(shard, entry_id)])
        log.warning("group entry delivered again; skipped", entry_id=entry_id, shard=shard)
        return True

    # -- one entry
    def take(self, shard: int, entry_id: str, fields: dict | None) -> None:
        """Decide about one entry: accept into the batch, or drop and count."""
        w = self.window
        self.reader.last_taken[shard] = entry_id
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
            return
        zero, behind = is_zero_variance(group), staleness(group, self.state.policy_version)
        self.outcomes.count(group, zero, w.counters, behind)  # solved, no signal, or signal
        if zero:
            w.counters.dropped_zero_variance += 1
        elif behind > self.cfg.max_staleness:
            w.counters.dropped_stale += 1
        else:
            w.counters.staleness[str(behind)] = w.counters.staleness.get(str(behind), 0) + 1
            w.groups.append(group)
            if len(w.groups) == self.cfg.batch_groups:
                self.step()
        self._judge()

    def _judge(self) -> None:
        """Say so once the groups have had no signal for long; stop once the task is solved."""
        cfg, st = self.cfg, self.state
        if line := self.outcomes.no_signal(cfg.no_signal_warn_groups, st.step):
            log.warning(line)
        if not st.verdict:
            st.verdict = self.outcomes.solved(cfg.stop_when_solved, st.step)

    # -- one optimizer step
    def step(self) -> None:
        """Train on the window's groups, fold the window into the state, then publish and
        checkpoint when they are due."""
        w, st, cfg = self.window, self.state, self.cfg
        coef = self.entropy_coef()
        stats = self._train_batch(w.groups, coef)
        if cfg.entropy_target is not None:
            st.entropy_coef = adapt_entropy_coef(
                coef, stats.entropy, cfg.entropy_target, cfg.entropy_coef_step,
                cfg.entropy_coef_max,
            )  # fmt: skip
        self._commit(w, stats)
        self._log_step(w, stats, coef)
        if st.step % cfg.sync_every == 0:
            st.policy_version += 1
            self.publish()
        if st.step % cfg.checkpoint_every == 0:
            self.checkpoint()
        self.report()

    def _train_batch(self, groups: list[schema.Group], coef: float) -> StepStats:
        step_cfg = msgspec.structs.replace(self.cfg, entropy_coef=coef)  # this step's coefficient
        step, ref = self.state.step, self.ref_model
        version = weights_version(step, self.state.policy_version, self.cfg.sync_every)
        if self.trainer is not None:
            return self.trainer.step(groups, self.optimizer, step_cfg, step, ref, version)
        batch = make_batch(groups, self.tokenizer.pad_token_id, self.cfg.scale_rewards, version)
        return train_step(self.model, self.optimizer, batch, step_cfg, step, ref)

    def _commit(self, w: _Window, stats: StepStats) -> None:
        """The window's entries and counters become part of the state (and of the next
        checkpoint); a fresh window opens."""
        st = self.state
        w.counters.groups_applied += len(w.groups)
        w.counters.tokens_trained += stats.tokens
        w.counters.is_tokens += stats.is_tokens
        w.counters.is_clipped += stats.is_clipped
        st.counters.add(w.counters)
        if self.reader.sharded:
            for shard, entry_id in w.ids:  # in each shard, ids were taken in order
                st.last_ids[self.reader.shards[shard].label] = entry_id
        else:
            st.last_id = w.ids[-1][1]
        st.step += 1
        st.reward_mean = stats.reward_mean
        st.loss = stats.loss
        self.unacked.extend(w.ids)
        self.window = _Window()
        self.steps.record(st.step, stats)

    def _log_step(self, w: _Window, stats: StepStats, coef: float) -> None:
        """The step's scalars to the reporters; one console line every ``logging_steps``."""
        st = self.state
        consumed, drops = w.counters.groups_consumed, w.counters.drop_fractions()
        now = time.monotonic()
        scalars = step_scalars(stats, w.counters.staleness, now - self.last_step_at)
        scalars["train/entropy_coef"] = coef
        solved, no_signal = self.outcomes.rate(SOLVED), self.outcomes.rate(NO_SIGNAL)
        scalars.update({"groups/solved_rate": solved, "groups/no_signal_rate": no_signal})
        self.last_step_at = now
        if st.step % self.cfg.logging_steps == 0:
            log.info(
                "step", step=st.step, loss=round(stats.loss, 6), reward_mean=stats.reward_mean,
                entropy=round(stats.entropy, 4), entropy_coef=round(coef, 6),
                grad_norm=round(stats.grad_norm, 4), lr=stats.lr, tokens=stats.tokens,
                step_seconds=round(stats.seconds, 3), groups_consumed=consumed,
                dropped={k: v for k, v in drops.items() if v}, solved_rate=solved,
                no_signal_rate=no_signal, **stats.mismatch.means(),
                **self.outcomes.by_env.line(),  # a mixture: reward and rates per environment
            )  # fmt: skip
        self.reporters.log(st.step, scalars)

    def publish(self) -> None:
        st, cfg = self.state, self.cfg
        weights = self.trainer.full_weights() if self.trainer else None  # FSDP: all-gathered
        pv = self.publisher.publish(
            self.r, self.keys, self.model, self.tokenizer, self.out / "policy", st.policy_version,
            st.step, lora=cfg.lora_r > 0, keep=cfg.keep_policy_versions, state_dict=weights,
        )  # fmt: skip
        if pv is None:  # not written (a full disk) and so not announced: training goes on
            return
        structlog.contextvars.bind_contextvars(policy_version=pv.version)
        due = pv.version == 0 or st.step % cfg.logging_steps == 0
        (log.info if due else log.debug)("published", step=pv.step, path=pv.path)

    def checkpoint(self) -> None:
        """Checkpoint, and only then XACK what it covers."""
        st = self.state
        saved = msgspec.structs.replace(st, checkpoint_step=st.step, checkpoint_time=time.time())
        out, keep = self.out / "checkpoints", self.cfg.keep_checkpoints
        writer = self.trainer.shard_writer(self.optimizer) if self.trainer else None  # FSDP
        path = save_checkpoint(out, saved, self.model, self.optimizer, keep, writer)  # or raises
        st.checkpoint_step, st.checkpoint_time = saved.checkpoint_step, saved.checkpoint_time
        failpoint("after_checkpoint", st.step)
        self.reader.ack(self.unacked)
        self.unacked = []
        log.info("checkpoint", step=st.step, path=str(path), last_id=st.last_id)

    def report(self, status: str = "running") -> None:
        """Progress for ``streamrl status``: committed counters plus the open window."""
        st, c = self.state, Counters()
        c.add(st.counters)
        c.add(self.window.counters)
        fields: dict[str, str | int | float] = {
            "status": status,
            "pid": os.getpid(),
            **st.fields(self.reader.sharded),
            **c.fields(),  # counters, drop fractions, applied staleness
            "waiting_groups": len(self.window.groups),
            "shards": len(self.reader.shards),
            "updated_at": time.time(),
            **self.outcomes.fields(),  # solved and no-signal rates over the last groups
        }
        fields.update(self.steps.fields())  # lr, grad norm, entropy, training mismatch
        fields["entropy_coef"] = round(self.entropy_coef(), 6)
        fields.update(rank_fields(self.ranks))  # data parallel: pids, parameters held
        if self.group_size:
            # admission: rollouts run (max_staleness + 1) batches ahead, 0 holds the batch too
            batch, s = self.cfg.batch_groups * self.group_size, self.cfg.max_staleness
            fields.update(max_in_flight=(s + 1) * batch, max_staleness=s)
        self.r.hset(self.keys.learner, mapping=fields)
