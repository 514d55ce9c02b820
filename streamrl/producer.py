"""Task producers: prompts from an environment's seeded generator or from JSONL rows, each
pushed ``group_size`` times as samples ``<prompt_id>:<k>``.

A producer records its position per source in Redis and pushes each batch with a
compare-and-set on that position (one Lua script), so a restarted producer continues where
the last one stopped and a re-sent batch is never pushed twice.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import Scripts
from streamrl.envs import Environment

BATCH = 256


@dataclass
class ProduceResult:
    source: str
    prompts: int = 0  # pushed by this call
    samples: int = 0
    skipped: int = 0  # already pushed by an earlier producer of the same source
    rejected: list[str] = field(default_factory=list)  # bad rows, with their reasons
    position: int = 0


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


class LearnerAdmission:
    """Keeps rollouts from running ahead of training: at most ``max_in_flight`` samples
    pushed but not yet settled (consumed by the learner, or in a dropped group). The limit is
    ``(max_staleness + 1) x batch samples``; the learner publishes it in its progress hash
    (``max_in_flight``), and without a learner there is no limit."""

    def __init__(
        self,
        r: redis.Redis,
        run: str,
        group_size: int,
        limit: int | None = None,
        poll_s: float = 0.02,
        override: bool = False,
        on_wait: Callable[[int, int], None] | None = None,
    ):
        self.r = r
        self.keys = Keys(run)
        self.group_size = group_size
        self.limit = limit  # until the learner publishes its own (it may still be loading)
        self.override = override  # keep `limit` even then (experiments that fix the window)
        self.on_wait = on_wait  # told (in flight, limit) every few seconds while held back
        self.poll_s = poll_s
        self.waited_s = 0.0

    def in_flight(self) -> tuple[int, int | None]:
        pipe = self.r.pipeline(transaction=False)
        pipe.xinfo_stream(self.keys.tasks)
        pipe.hmget(self.keys.learner, ["max_in_flight", "samples_consumed"])
        pipe.hget(self.keys.stats, "groups_dropped")
        info, (limit, consumed), dropped = pipe.execute()
        settled = int(consumed or 0) + int(dropped or 0) * self.group_size
        if self.override or not limit:
            return info["entries-added"] - settled, self.limit
        return info["entries-added"] - settled, int(limit)

    def __call__(self, n: int) -> None:
        start = last_told = time.monotonic()
        while True:
            try:
                flying, limit = self.in_flight()
            except redis.ResponseError:  # no tasks stream yet
                return
            if limit is None or flying + n <= limit or flying <= 0:
                break
            if self.on_wait is not None and time.monotonic() - last_told > 5.0:
                self.on_wait(flying, limit)
                last_told = time.monotonic()
            time.sleep(self.poll_s)
        self.waited_s += time.monotonic() - start


def admission_limit(learner: dict[str, Any], group_size: int) -> int | None:
    """``(max_staleness + 1) x batch samples`` from a run config's ``[learner]`` table."""
    if not learner:
        return None
    batch = int(learner.get("batch_groups", 8)) * group_size
    return (int(learner.get("max_staleness", 4)) + 1) * batch


class Producer:
    def __init__(
        self,
        r: redis.Redis,
        run: str,
        admission: Admission | None = None,
        batch_samples: int = BATCH,
    ):
        self.r = r
        self.keys = Keys(run)
        self.scripts = Scripts(r)
        self.admission = admission
        self.batch_samples = batch_samples

    def position(self, source: str) -> int:
        return int(self.r.get(self.keys.producer(source)) or 0)

    def _push(self, source: str, start: int, end: int, tasks: list[schema.Task]) -> bool:
        if self.admission is not None:
            self.admission(len(tasks))
        args: list[Any] = [str(start), str(end)]
        for t in tasks:
            args += [t.task_id, schema.encode(t)]
        n = self.scripts.produce(keys=[self.keys.tasks, self.keys.producer(source)], args=args)
        return n >= 0

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
            batch: list[schema.Task] = []
            for i in range(pos, end):
                prompt = env.generate(random.Random(f"{seed}:{i}"), i)
                pid = f"{env.name}-s{seed}-{i:07d}"
                batch += _tasks(pid, spec, group_size, prompt.input, prompt.data, seed)
            if self._push(source, pos, end, batch):
                res.prompts += end - pos
                res.samples += len(batch)
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
    ) -> ProduceResult:
        """Push one prompt per row. Bad rows go to the dead-letter stream with their line
        number and reason; the rest are pushed."""
        path = Path(path)
        source = f"file:{path.resolve()}"
        res = ProduceResult(source)
        pos = self.position(source)
        res.skipped = pos
        rows = list(_read_rows(path))
        while pos < len(rows):
            end = min(len(rows), pos + max(1, self.batch_samples // group_size))
            batch: list[schema.Task] = []
            rejects: list[tuple[int, str]] = []
            for line_no in range(pos, end):
                if not rows[line_no].strip():
                    continue
                try:
                    inp, data, pid = row_to_prompt(rows[line_no])
                except ValueError as e:
                    rejects.append((line_no, f"{path.name}:{line_no + 1}: {e}"))
                    continue
                pid = pid or f"{path.stem}-{line_no + 1:07d}"
                batch += _tasks(pid, data.pop("env", env), group_size, inp, data, 0)
            if self._push(source, pos, end, batch):
                res.prompts += len(batch) // group_size
                res.samples += len(batch)
                for line_no, reason in rejects:
                    self._reject(reason, rows[line_no])
                res.rejected += [reason for _, reason in rejects]
            pos = self.position(source)
            if progress:
                progress(pos)
        res.position = pos
        return res

    def _reject(self, reason: str, raw: str) -> None:
        dl = schema.DeadLetter(
            stage="produce", entry_id="", reason=reason, payload=raw.encode(), at=time.time()
        )
        self.r.xadd(self.keys.dead, {"id": "", "p": schema.encode(dl)})
        self.r.hincrby(self.keys.stats, "dead_letters", 1)


def _read_rows(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        yield from (line.rstrip("\n") for line in f)


def row_to_prompt(line: str) -> tuple[list[schema.Item], dict[str, Any], str]:
    """A JSONL row -> (input items, verifier data, prompt id or "").

    Accepted shapes: NeMo Gym rows (``responses_create_params.input`` as a string or a list of
    Responses items; every other top-level field becomes verifier data), or plain rows with a
    ``prompt`` (string) or ``input`` (items). An optional ``id`` names the prompt and ``env``
    picks the environment for this row.
    """
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    row = dict(row)
    params = row.pop("responses_create_params", None)
    raw_input = params.get("input") if isinstance(params, dict) else None
    if raw_input is None:
        raw_input = row.pop("input", None) or row.pop("prompt", None)
    if raw_input is None:
        raise ValueError("no prompt: need responses_create_params.input, input or prompt")
    if isinstance(raw_input, str):
        raw_input = [{"type": "message", "role": "user", "content": raw_input}]
    items = []
    for i, item in enumerate(raw_input if isinstance(raw_input, list) else [raw_input]):
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {"type": "message", **item}
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            # Responses content parts -> plain text
            item = {**item, "content": "".join(p.get("text", "") for p in item["content"])}
        try:
            items.append(msgspec.convert(item, schema.Item))
        except msgspec.ValidationError as e:
            raise ValueError(f"input item {i}: {e}") from None
    pid = str(row.pop("id", "") or "")
    row.pop("response", None)
    row.pop("reward", None)
    return items, row, pid
