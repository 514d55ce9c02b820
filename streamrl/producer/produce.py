"""Task producers: prompts from an environment's seeded generator or from JSONL rows, each
pushed ``group_size`` times as samples ``<prompt_id>:<k>``.

A producer records its position per source in Redis and pushes each batch with a
compare-and-set on that position (one Lua script), so a restarted producer continues where
the last one stopped and a re-sent batch is never pushed twice.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from streamrl import schema
from streamrl.bus.keys import Keys, shard_keys, shard_of
from streamrl.bus.shards import shard_count
from streamrl.bus.streams import Scripts
from streamrl.envs import Environment
from streamrl.producer.datasets import JsonlRows, Rows
from streamrl.producer.rows import read_rows
from streamrl.responses import dict_to_prompt
from streamrl.verifiers.reward_functions import STANDARD_PROMPT

BATCH = 256


@dataclass
class ProduceResult:
    source: str
    prompts: int = 0  # pushed by this call
    samples: int = 0
    skipped: int = 0  # already pushed by an earlier producer of the same source
    rejected: list[str] = field(default_factory=list)  # bad rows, with their reasons
    position: int = 0


def training_seed(seed: int, index: int) -> str:
    """The rng seed of prompt ``index`` of an environment's generator under ``seed``: a pure
    function of both, so a restarted producer pushes the same prompts, and ``streamrl eval``
    can tell which prompts training saw."""
    return f"{seed}:{index}"


def _tasks(prompt_id: str, env: str, group_size: int, inp, data, seed: int) -> list[schema.Task]:
    now = time.time()
    return [
        schema.Task(
            task_id=f"{prompt_id}:{k}",
            prompt_id=prompt_id,
            k=k,
            group_size=group_size,
            env=env,
            input=inp,
            data=data,
            seed=seed,
            created_at=now,
        )
        for k in range(group_size)
    ]


Admission = Callable[[int], None]  # blocks until `n` more samples may enter the pipeline


class Producer:
    """Pushes prompts. A sharded run's prompts go round robin over its shards (prompt ``i`` to
    shard ``i mod N``); each shard keeps its own position, advanced with its own
    compare-and-set, so a producer that stopped between two shards' pushes resumes each shard
    where it stands: nothing is pushed twice or skipped."""

    def __init__(
        self,
        r: redis.Redis,
        run: str,
        admission: Admission | None = None,
        batch_samples: int = BATCH,
        shards: int | None = None,
    ):
        self.r = r
        self.keys = Keys(run)
        self.shards = shard_keys(run, shards if shards is not None else shard_count(r, run))
        self.scripts = Scripts(r)
        self.admission = admission
        self.batch_samples = batch_samples

    def position(self, source: str) -> int:
        """Prompts of ``source`` pushed to every shard."""
        return min(self._positions(source))

    def _positions(self, source: str) -> list[int]:
        return [int(self.r.get(k.producer(source)) or 0) for k in self.shards]

    def _push(
        self, source: str, start: int, end: int, batch: list[tuple[int, list[schema.Task]]]
    ) -> tuple[int, set[int]]:
        """Push prompts ``start..end-1`` (``batch``: (index, samples) of those to push).
        Returns the samples pushed and the shards whose push went through (a stale position
        means another producer pushed them first)."""
        if self.admission is not None:
            self.admission(sum(len(tasks) for _, tasks in batch))
        positions = [start] if len(self.shards) == 1 else self._positions(source)
        pushed, shards = 0, set()
        for s, keys in enumerate(self.shards):
            at = positions[s]
            if at >= end:
                continue
            args: list[Any] = [str(at), str(end)]
            for i, tasks in batch:
                if i >= at and shard_of(i, len(self.shards)) == s:
                    for t in tasks:
                        args += [t.task_id, schema.encode(t)]
            n = self.scripts.produce(keys=[keys.tasks, keys.producer(source)], args=args)
            if n >= 0:
                pushed += n
                shards.add(s)
        return pushed, shards

    def from_env(
        self,
        env: Environment,
        count: int,
        group_size: int,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        env_spec: str | None = None,
    ) -> ProduceResult:
        """Push prompts ``0..count-1`` of ``env``'s generator under ``seed``. Prompt ``i`` is
        always the same prompt for the same seed, wherever a restarted producer resumes.
        ``env_spec`` is how workers find the environment (a registry name or module:Class)."""
        spec = env_spec or env.name
        source = f"env:{env.name}:seed={seed}"
        res = ProduceResult(source)
        pos = self.position(source)
        res.skipped = min(pos, count)
        while pos < count:
            end = min(count, pos + max(1, self.batch_samples // group_size))
            batch: list[tuple[int, list[schema.Task]]] = []
            for i in range(pos, end):
                prompt = env.generate(random.Random(training_seed(seed, i)), i)
                pid = f"{env.name}-s{seed}-{i:07d}"
                batch.append((i, _tasks(pid, spec, group_size, prompt.input, prompt.data, seed)))
            pushed, _ = self._push(source, pos, end, batch)
            res.prompts += pushed // group_size
            res.samples += pushed
            pos = self.position(source)
            if progress:
                progress(pos)
        res.position = pos
        return res

    def from_jsonl(
        self,
        path: str | Path,
        env: str,
        group_size: int,
        progress: Callable[[int], None] | None = None,
        limit: int | None = None,
    ) -> ProduceResult:
        """Push one prompt per row of the first ``limit`` lines (all by default). A row that
        cannot be read (not UTF-8, not JSON, nested too deeply, no prompt or an empty one, items
        of the wrong shape, an id used by an earlier row) goes to the dead-letter stream with
        its line number and reason; every other row is pushed."""
        path = Path(path)
        rows = JsonlRows(path, f"file:{path.resolve()}", {}, list(read_rows(path))[:limit])
        return self.from_rows(rows, env, group_size, progress)

    def from_rows(
        self,
        rows: Rows,
        env: str,
        group_size: int,
        progress: Callable[[int], None] | None = None,
        standard_prompts: bool = False,
    ) -> ProduceResult:
        """Push one prompt per row of a dataset (``producer.datasets.open_rows``: JSONL, a
        saved ``datasets`` directory, Parquet, Arrow); bad rows are dead-lettered with where
        they are and why, as ``from_jsonl`` does. ``standard_prompts``: mark rows whose prompt
        is a string (TRL's standard form), so the run's reward functions are given strings."""
        res = ProduceResult(rows.source)
        pos = self.position(rows.source)
        res.skipped = pos
        step = max(1, self.batch_samples // group_size)
        first_use: dict[str, int] = {}  # prompt id -> index of its first row
        for start in range(0, pos, step):  # rows pushed by an earlier producer keep their ids
            for i, row in enumerate(rows.fetch(start, min(pos, start + step)), start):
                with contextlib.suppress(ValueError):
                    first_use.setdefault(_row_id(row, rows, i), i)
        while pos < len(rows):
            end = min(len(rows), pos + step)
            rows_in = _RowBatch(rows, env, group_size, first_use, standard_prompts)
            for i, row in enumerate(rows.fetch(pos, end), pos):
                rows_in.add(i, row)
            pushed, shards = self._push(rows.source, pos, end, rows_in.tasks)
            res.prompts += pushed // group_size
            res.samples += pushed
            res.rejected += self._reject_rows(rows_in.rejects, rows, shards)
            pos = self.position(rows.source)
            if progress:
                progress(pos)
        res.position = pos
        return res

    def _reject_rows(
        self, rejects: list[tuple[int, str]], rows: Rows, pushed_to: set[int]
    ) -> list[str]:
        """Dead-letter the bad rows of the shards this producer's push covered (a shard
        another producer pushed first has its bad rows dead-lettered by that one)."""
        n = len(self.shards)
        mine = [(line_no, why) for line_no, why in rejects if shard_of(line_no, n) in pushed_to]
        for line_no, reason in mine:
            self._reject(reason, rows.raw(line_no), self.shards[shard_of(line_no, n)])
        return [reason for _, reason in mine]

    def _reject(self, reason: str, raw: bytes, keys: Keys) -> None:
        dl = schema.DeadLetter(
            stage="produce", entry_id="", reason=reason, payload=raw, at=time.time()
        )
        self.r.xadd(keys.dead, {"id": "", "p": schema.encode(dl)})
        self.r.hincrby(keys.stats, "dead_letters", 1)


def _row_id(row: Any, rows: Rows, i: int) -> str:
    """The prompt id row ``i`` gets (its own, or the default); ValueError for a bad row."""
    if isinstance(row, ValueError):
        raise row
    return dict_to_prompt(row)[2] or rows.default_id(i)


@dataclass
class _RowBatch:
    """One batch of a dataset's rows: the samples of the good ones and why the bad ones were
    refused (``<where>: why``)."""

    rows: Rows
    env: str
    group_size: int
    first_use: dict[str, int]  # prompt id -> index of its first row, shared across batches
    standard_prompts: bool = False
    tasks: list[tuple[int, list[schema.Task]]] = field(default_factory=list)
    rejects: list[tuple[int, str]] = field(default_factory=list)

    def add(self, i: int, row: Any) -> None:
        if row is None:  # a blank line
            return
        try:
            if isinstance(row, ValueError):
                raise row
            inp, data, pid = dict_to_prompt(row)
            pid = pid or self.rows.default_id(i)
            if pid in self.first_use:
                first = self.rows.place(self.first_use[pid])
                raise ValueError(f"id {pid!r} is already used on {first}")
        except ValueError as e:
            self.rejects.append((i, f"{self.rows.where(i)}: {e}"))
            return
        self.first_use[pid] = i
        env = data.pop("env", self.env)
        if self.standard_prompts and _standard(row):
            data[STANDARD_PROMPT] = True
        self.tasks.append((i, _tasks(pid, env, self.group_size, inp, data, 0)))


def _standard(row: dict[str, Any]) -> bool:
    """A row whose prompt is a plain ``prompt`` string: TRL's standard form."""
    other_prompt = "input" in row or "responses_create_params" in row
    return isinstance(row.get("prompt"), str) and not other_prompt
