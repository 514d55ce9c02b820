"""Weighted mixtures of environments: which environment each prompt comes from.

The mixture lives in Redis (``srl:{run}:mix``, a ``config.Mixture``), written from the run
config's ``[[envs]]`` by the first producer and changed by ``streamrl mix`` while the run goes
on; the producer reads it again before every batch, so an environment added, re-weighted,
removed or paused takes effect within one batch, with no restart anywhere.

Prompt ``i``'s environment is a pure function of the seed, ``i`` and the live entries' weights
(``draw``): the same mixture gives the same sequence on every machine and after a restart.
All ``group_size`` samples of a prompt are that prompt's: a group never mixes environments.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from streamrl import defaults as d
from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.values import as_str
from streamrl.config import MIXTURE, EnvEntry, Mixture
from streamrl.envs import Environment, make_env
from streamrl.producer.datasets import Rows, open_rows
from streamrl.producer.produce import Producer, ProduceResult, _RowBatch, _tasks, training_seed

CANARY = d.CANARY_PREFIX  # the prompt id prefix of canary prompts (producer.tripwires reads it)


def draw(entries: list[EnvEntry], seed: int, index: int) -> EnvEntry:
    """The environment of prompt ``index``: one uniform number from ``(seed, index)``, laid on
    the entries' cumulative weights (in the mixture's order)."""
    total = sum(e.weight for e in entries)
    u = random.Random(f"{seed}:mix:{index}").random() * total
    for e in entries:
        u -= e.weight
        if u < 0:
            return e
    return entries[-1]


def load(r: redis.Redis, run: str) -> Mixture | None:
    raw = r.get(Keys(run).mix)
    return MIXTURE.decode(raw) if raw else None


def paused(r: redis.Redis, run: str) -> dict[str, str]:
    """Environment name -> why its prompts are paused."""
    return {as_str(k): as_str(v) for k, v in r.hgetall(Keys(run).mix_paused).items()}


def pause(r: redis.Redis, run: str, name: str, reason: str) -> None:
    r.hset(Keys(run).mix_paused, name, reason)


def resume(r: redis.Redis, run: str, name: str) -> bool:
    return bool(r.hdel(Keys(run).mix_paused, name))


def ensure(r: redis.Redis, run: str, mixture: Mixture) -> Mixture:
    """The stored mixture; ``mixture`` is stored first when the run has none (the stored one
    wins: ``streamrl mix`` may have changed it since the config was written)."""
    r.set(Keys(run).mix, msgspec.msgpack.encode(mixture), nx=True)
    return load(r, run) or mixture


def update(r: redis.Redis, run: str, change: Callable[[Mixture], None]) -> Mixture:
    """Apply ``change`` to the stored mixture and store it with its version moved on, as one
    optimistic transaction (two ``streamrl mix`` at once: neither change is lost)."""
    key = Keys(run).mix
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                raw = pipe.get(key)
                mix = MIXTURE.decode(raw) if raw else Mixture()
                change(mix)
                mix = Mixture(version=mix.version + 1, envs=mix.envs)  # checks the names
                pipe.multi()
                pipe.set(key, msgspec.msgpack.encode(mix))
                pipe.execute()
                return mix
            except redis.WatchError:
                continue


@dataclass
class _Source:
    """What one entry's prompts come from: its generator, or its dataset's rows."""

    entry: EnvEntry
    env: Environment | None = None
    rows: Rows | None = None
    first_use: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, entry: EnvEntry) -> _Source:
        if entry.dataset:
            return cls(entry, rows=open_rows(entry.dataset))
        return cls(entry, env=make_env(entry.env, **entry.env_options))


@dataclass
class MixedProducer:
    """Pushes ``count`` prompts drawn from the run's stored mixture (see the module's doc).
    ``on_batch`` runs before each batch (the tripwires), ``on_wait`` while every environment
    is paused. One producer per mixture: a dataset's row cursor is advanced after its push."""

    producer: Producer
    run: str
    group_size: int
    seed: int = 0
    on_batch: Callable[[], None] | None = None
    on_wait: Callable[[dict[str, str]], None] | None = None
    sources: dict[str, _Source] = field(default_factory=dict)
    drawn: dict[str, int] = field(default_factory=dict)  # prompts pushed by this call, by env

    @property
    def source(self) -> str:
        return f"mix:s{self.seed}"

    def run_until(self, count: int) -> ProduceResult:
        p, r = self.producer, self.producer.r
        res = ProduceResult(self.source)
        pos = p.position(self.source)
        res.skipped = min(pos, count)
        step = max(1, p.batch_samples // self.group_size)
        while pos < count:
            if self.on_batch is not None:
                self.on_batch()
            mix, held = load(r, self.run) or Mixture(), paused(r, self.run)
            live = [e for e in mix.envs if e.live and e.name not in held and not self._done(e)]
            if not live:
                if not any(e.live and not self._done(e) for e in mix.envs):
                    break  # nothing left to draw from, ever: removed or exhausted
                if self.on_wait is not None:
                    self.on_wait(held)
                time.sleep(d.MIX_POLL_S)
                continue
            end = min(count, pos + step)
            batch, rows_used, rejects = self._batch(live, pos, end)
            pushed, _ = p._push(self.source, pos, end, batch)
            if pushed:
                for name, n in rows_used.items():
                    r.hincrby(Keys(self.run).mix_rows, name, n)
                for reason, raw, keys in rejects:
                    p._reject(reason, raw, keys)
                    res.rejected.append(reason)
                for _, tasks in batch:
                    name = tasks[0].env
                    self.drawn[name] = self.drawn.get(name, 0) + 1
            res.prompts += pushed // self.group_size
            res.samples += pushed
            pos = p.position(self.source)
        res.position = pos
        return res

    def _done(self, entry: EnvEntry) -> bool:
        """A dataset entry whose every row is pushed."""
        if not entry.dataset:
            return False
        rows = self._source(entry).rows
        return rows is not None and self._row(entry) >= len(rows)

    def _row(self, entry: EnvEntry) -> int:
        return int(self.producer.r.hget(Keys(self.run).mix_rows, entry.name) or 0)

    def _source(self, entry: EnvEntry) -> _Source:
        src = self.sources.get(entry.name)
        if src is None or src.entry != entry:  # new, or changed by `streamrl mix`
            src = self.sources[entry.name] = _Source.of(entry)
        return src

    def _batch(self, live: list[EnvEntry], start: int, end: int) -> tuple[list, dict, list]:
        """Prompts ``start..end-1``: their samples, the dataset rows used per entry, and the
        bad rows (reason, raw row, the shard keys its dead letter goes to)."""
        batch: list[tuple[int, list[schema.Task]]] = []
        rows_used: dict[str, int] = {}
        rejects: list[tuple[str, bytes, Keys]] = []
        for i in range(start, end):
            entry = draw(live, self.seed, i)
            src = self._source(entry)
            if src.rows is not None:
                j = self._row(entry) + rows_used.get(entry.name, 0)
                if j >= len(src.rows):
                    continue  # exhausted inside this batch: this prompt index stays empty
                rows_used[entry.name] = rows_used.get(entry.name, 0) + 1
                rb = _RowBatch(src.rows, entry.name, self.group_size, src.first_use)
                rb.add(j, src.rows.fetch(j, j + 1)[0])
                for _, tasks in rb.tasks:
                    for t in tasks:  # ids unique across the mixture's datasets
                        t.prompt_id = f"{entry.name}-{t.prompt_id}"
                        t.task_id = f"{t.prompt_id}:{t.k}"
                    batch.append((i, tasks))
                shard = self.producer.shards[i % len(self.producer.shards)]
                rejects += [(why, src.rows.raw(j), shard) for _, why in rb.rejects]
                continue
            batch.append((i, self._generated(entry, src, i)))
        return batch, rows_used, rejects

    def _generated(self, entry: EnvEntry, src: _Source, i: int) -> list[schema.Task]:
        """Prompt ``i`` from the entry's generator, or one of its canaries."""
        assert src.env is not None
        tw = entry.tripwires
        canary = tw.canary_every and random.Random(f"{self.seed}:canary:{i}").random() < (
            1 / tw.canary_every
        )
        if canary:
            j = i % tw.canaries
            prompt = src.env.generate(random.Random(f"canary:{j}"), j)
            pid = f"{CANARY}{entry.name}-{j}-s{self.seed}-{i:07d}"
        else:
            prompt = src.env.generate(random.Random(training_seed(self.seed, i)), i)
            pid = f"{entry.name}-s{self.seed}-{i:07d}"
        return _tasks(pid, entry.name, self.group_size, prompt.input, prompt.data, self.seed)


def describe(mix: Mixture, held: dict[str, str]) -> list[dict[str, Any]]:
    """One row per environment for ``streamrl mix`` and ``streamrl status``: its weight, its
    share of what is drawn now, and whether it is paused or removed."""
    live = [e for e in mix.envs if e.live and e.name not in held]
    total = sum(e.weight for e in live)
    return [
        {
            "name": e.name,
            "env": e.env,
            "weight": e.weight,
            "share": round(e.weight / total, 4) if e in live and total else 0.0,
            "removed": e.removed,
            "paused": held.get(e.name, ""),
            "source": e.dataset or "generator",
        }
        for e in mix.envs
    ]
