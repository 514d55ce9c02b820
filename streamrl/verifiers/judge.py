"""An LLM as a judge: ``verifier = "judge"`` and a ``[judge]`` table (``config.JudgeConfig``)
score a trajectory by asking a model behind any OpenAI-compatible server (vLLM, a hosted API).

One call, in order:

1. the rubric ``prompt`` is filled with ``str.format``: ``{prompt}`` (the task's input as text),
   ``{response}`` (the episode after it: the assistant's text, tool calls and their outputs) and
   each of the task's data columns (``{answer}``, ...);
2. the cache, ``judge:cache:<version>:<digest of the filled messages>`` in the run's Redis: a
   redelivered or re-verified sample whose judge input has been answered before is not sent
   again (only parsed answers are kept, for ``cache_ttl_s``); a canary prompt's sample (the
   tripwires' fixed prompts) is always asked afresh, so that a judge that drifts behind the
   same version moves the canaries' reward;
3. a slot of the endpoint's pool (``streamrl.bus.limiter``): ``max_in_flight`` calls and
   ``max_per_second`` starts across *every* verifier worker of the run;
4. ``POST /v1/chat/completions``; the first group of ``score_pattern``'s first match in the
   answer is the score N, and the reward is ``(N - min_score) / (max_score - min_score)``.

A verifier worker first asks for its whole batch side by side (``prefetch``: up to
``max_in_flight`` threads, every call still under the pool), then scores the batch in order
from those answers, so one worker keeps the judge busy instead of waiting on each answer.

Failures are infrastructure, never a reward: a connection error, a time-out, 408/425/429/5xx,
an answer that is not a chat completion or holds no score in ``[min_score, max_score]`` are
retried ``retries`` times with capped exponential backoff (each attempt holding a pool slot
only while its request is out), then raise ``JudgeUnavailable``; the verifier worker retries
the sample and dead-letters it with that reason. Another 4xx (a wrong model name, a bad key)
is raised at once. A 429 or 503 is the endpoint saying it is overloaded: its ``Retry-After``
(seconds or an HTTP date; ``backoff_s`` without one), capped at ``retry_after_max_s``, holds
the whole run's pool off the endpoint (no worker starts a call until it has passed) and is the
least the told call waits before its next attempt. The Score keeps the filled prompt, the raw
answer and the parsed score in ``info["judge"]``.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import msgspec
import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.limiter import CallPool, PoolTimeout
from streamrl.config import JUDGE, JudgeConfig
from streamrl.defaults import CANARY_PREFIX, JUDGE_LEASE_SLACK_S
from streamrl.http import Retryable, RetryPolicy, httpx_api, server_root
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    JudgeAnswer,
    Message,
    Task,
    Trajectory,
)

_RETRY_STATUS = frozenset({408, 425, 429})
_OVERLOADED = frozenset({429, 503})  # the endpoint as a whole: every worker backs off
_SNIPPET = 300


class JudgeUnavailable(Exception):
    """The judge could not give a score (down, timing out, refusing, unreadable): never a 0."""


def as_text(items: list[Item]) -> str:
    """Responses items as the plain text a judge reads: a lone message is its content, else
    one ``role: content`` line per message, calls and outputs marked."""
    if len(items) == 1 and isinstance(items[0], Message):
        return items[0].content
    lines = []
    for item in items:
        if isinstance(item, Message):
            lines.append(f"{item.role}: {item.content}")
        elif isinstance(item, FunctionCall):
            lines.append(f"call {item.name}({item.arguments})")
        elif isinstance(item, FunctionCallOutput):
            lines.append(f"output: {item.output}")
    return "\n".join(lines)


def fill(template: str, task: Task, trajectory: Trajectory) -> str:
    """The rubric prompt for one trajectory; a field the task lacks is a ValueError."""
    fields: dict[str, Any] = {
        k: v if isinstance(v, str) else json.dumps(v)
        for k, v in task.data.items()
        if not k.startswith("_")  # streamrl's own marks, not columns
    }
    fields["prompt"] = as_text(task.input)
    fields["response"] = as_text(trajectory.items[trajectory.n_input :])
    try:
        return template.format_map(fields)
    except KeyError as e:
        raise ValueError(
            f"judge prompt field {{{e.args[0]}}} is not a column of task {task.task_id} "
            f"(it has: prompt, response, {', '.join(sorted(fields)[:20])})"
        ) from None


def parse_score(raw: str, cfg: JudgeConfig) -> float | None:
    """The score in the judge's answer, or None if there is none in range."""
    m = re.search(cfg.score_pattern, raw)
    if m is None or m.group(1) is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    if not math.isfinite(value) or not cfg.min_score <= value <= cfg.max_score:
        return None
    return value


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delay-seconds or an HTTP date); None when
    there is none or it cannot be read."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def config_version(cfg: JudgeConfig) -> str:
    """The judge's verifier version: its ``version`` and a digest of everything that changes
    what it answers (not where it is), so a changed rubric never reads stale cache entries and
    re-verifying with it shows up as drift."""
    what = (cfg.model, cfg.system, cfg.prompt, cfg.score_pattern, cfg.min_score, cfg.max_score,
            cfg.max_tokens, cfg.temperature)  # fmt: skip
    return f"{cfg.version}-{hashlib.sha256(repr(what).encode()).hexdigest()[:10]}"


def _canary(task: Task) -> bool:
    """A canary prompt's sample (``producer.mixture``): judged afresh every time."""
    return task.prompt_id.startswith(CANARY_PREFIX)


def _digest(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages).encode()).hexdigest()


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."


class Judge:
    """The run's judge in one verifier worker: its HTTP client, and the pool and cache it
    shares with the others through ``r`` (None: no pool, no cache; for checks only)."""

    def __init__(self, cfg: JudgeConfig, r: redis.Redis | None = None, run: str = "") -> None:
        self.cfg = cfg
        self.r = r
        self.keys = Keys(run) if run else None
        self.root = server_root(cfg.base_url)
        self.version = config_version(cfg)
        self.retry = RetryPolicy(cfg.retries + 1, cfg.backoff_s, cfg.backoff_max_s)
        self._client: Any = None
        self._ready: dict[str, tuple[JudgeAnswer, int, bool] | BaseException] = {}
        self._pool: CallPool | None = None
        endpoint = hashlib.sha256(self.root.encode()).hexdigest()[:12]
        if r is not None and self.keys is not None:
            self._pool = CallPool(
                r, self.keys.judge_pool(endpoint), cfg.max_in_flight, cfg.max_per_second,
                lease_s=cfg.timeout_s + JUDGE_LEASE_SLACK_S,
            )  # fmt: skip

    @property
    def verifier_id(self) -> tuple[str, str]:
        return JUDGE, self.version

    def messages(self, task: Task, trajectory: Trajectory) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return [*out, {"role": "user", "content": fill(self.cfg.prompt, task, trajectory)}]

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        """The reward in [0, 1] and what to keep in ``Score.info["judge"]``."""
        start = time.monotonic()
        messages = self.messages(task, trajectory)
        digest = _digest(messages)
        ready = self._ready.pop(digest, None)  # asked for already by ``prefetch``
        if isinstance(ready, BaseException):
            raise ready  # the sample's first attempt; the verifier worker makes the next
        if ready is None:
            ready = self._answer(messages, digest, fresh=_canary(task))
        answer, calls, cached = ready
        self._count("samples", 1, "cached", int(cached))
        cfg = self.cfg
        reward = (answer.score - cfg.min_score) / (cfg.max_score - cfg.min_score)
        info = {
            "prompt": answer.prompt,
            "raw": answer.raw,
            "score": answer.score,
            "model": cfg.model,
            "version": self.version,
            "cached": cached,
            "calls": calls,
            "seconds": round(time.monotonic() - start, 4),
        }
        return reward, info

    def prefetch(
        self, samples: list[tuple[Task, Trajectory]], beat: Callable[[], None], every_s: float
    ) -> None:
        """Ask for a batch's answers side by side (up to ``max_in_flight`` threads; the run's
        pool still bounds every call), so that one verifier worker keeps the judge busy rather
        than waiting on one answer at a time; ``score`` then takes them in order. ``beat()``
        runs every ``every_s`` seconds meanwhile (the lease's heartbeat). A failure is kept as
        the sample's first attempt."""
        self._ready.clear()
        jobs: dict[str, list[dict[str, str]]] = {}
        fresh: set[str] = set()
        for task, trajectory in samples:
            try:
                messages = self.messages(task, trajectory)
            except ValueError:
                continue  # the sample's own attempt says why
            digest = _digest(messages)
            jobs.setdefault(digest, messages)
            if _canary(task):
                fresh.add(digest)
        if len(jobs) < 2:
            return
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_in_flight, len(jobs))) as pool:
            futures = {pool.submit(self._answer, m, d, d in fresh): d for d, m in jobs.items()}
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=every_s)
                beat()
        for future, digest in futures.items():
            error = future.exception()
            self._ready[digest] = error if error is not None else future.result()

    def _answer(
        self, messages: list[dict[str, str]], digest: str, fresh: bool = False
    ) -> tuple[JudgeAnswer, int, bool]:
        """The answer (from the cache unless ``fresh``, or asked for with retries), the calls
        it took, and whether it came from the cache."""
        cached = None if fresh else self._cached(digest)
        if cached is not None:
            return cached, 0, True
        calls = 0

        def attempt() -> JudgeAnswer:
            nonlocal calls
            calls += 1
            self._count("calls", 1)  # before the call: a call cut short counts too
            return self._ask(messages)

        try:
            answer = self.retry.call(attempt, self._give_up)
        except JudgeUnavailable:
            self._count("failures", 1)
            raise
        self._store(digest, answer)
        return answer, calls, False

    # ---------------------------------------------------------------- one call
    def _ask(self, messages: list[dict[str, str]]) -> JudgeAnswer:
        """One request under a pool slot; Retryable says why another may help."""
        cfg = self.cfg
        body = {
            "model": cfg.model,
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
        }
        http = httpx_api()
        try:
            if self._pool is None:
                resp = self._post(body)
            else:
                with self._pool.slot(wait_s=cfg.timeout_s + cfg.retry_after_max_s):
                    resp = self._post(body)
        except PoolTimeout as e:
            raise Retryable(f"judge pool: {e}") from None
        except http.TimeoutException as e:
            why = f"judge timed out ({type(e).__name__}, timeout_s={cfg.timeout_s:g})"
            raise Retryable(why) from None
        except http.TransportError as e:
            raise Retryable(f"judge connection error: {type(e).__name__}: {e}") from None
        status = resp.status_code
        if status in _RETRY_STATUS or status >= 500:
            why = f"judge answered HTTP {status}: {_snippet(resp.text)}"
            raise Retryable(why, after_s=self._back_off(status, resp.headers, why))
        if status >= 400:
            raise JudgeUnavailable(
                f"judge refused the request, HTTP {status} (not retried): {_snippet(resp.text)}"
            )
        try:
            raw = resp.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            why = f"judge answer is not a chat completion: {_snippet(resp.text)}"
            raise Retryable(why) from None
        score = parse_score(raw, cfg)
        if score is None:
            raise Retryable(
                f"judge answer holds no score in [{cfg.min_score:g}, {cfg.max_score:g}] "
                f"matching {cfg.score_pattern!r}: {_snippet(raw)!r}"
            )
        return JudgeAnswer(prompt=messages[-1]["content"], raw=raw, score=score)

    def _back_off(self, status: int, headers: Any, why: str) -> float:
        """The least wait before the next attempt: the endpoint's ``Retry-After`` (capped);
        a 429 or 503 also holds the run's whole pool off the endpoint that long (backoff_s
        when it named no time)."""
        cfg = self.cfg
        asked = retry_after(headers.get("retry-after"))
        wait = min(asked if asked is not None else 0.0, cfg.retry_after_max_s)
        if status in _OVERLOADED:
            self._count("throttled", 1)
            hold = min(asked if asked is not None else cfg.backoff_s, cfg.retry_after_max_s)
            if self._pool is not None and hold > 0:
                self._pool.hold(hold, why)
        return wait

    def _post(self, body: dict[str, Any]) -> Any:
        if self._client is None:
            http = httpx_api()
            key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
            self._client = http.Client(
                timeout=http.Timeout(self.cfg.timeout_s),
                headers={"Authorization": f"Bearer {key}"} if key else None,
                trust_env=False,
            )
        return self._client.post(self.root + "/v1/chat/completions", json=body)

    def _give_up(self, last: BaseException) -> JudgeUnavailable:
        return JudgeUnavailable(f"{last} (after {self.retry.tries} attempts)")

    # ---------------------------------------------------------------- cache and counts
    def _cached(self, digest: str) -> JudgeAnswer | None:
        if self.r is None or self.keys is None or not self.cfg.cache_ttl_s:
            return None
        blob = self.r.get(self.keys.judge_cache(self.version, digest))
        if blob is None:
            return None
        try:
            return schema.check_version(schema.JUDGE_ANSWER.decode(blob))
        except msgspec.DecodeError:  # not ours, or newer than this code: ask again
            return None

    def _store(self, digest: str, answer: JudgeAnswer) -> None:
        if self.r is None or self.keys is None or not self.cfg.cache_ttl_s:
            return
        key = self.keys.judge_cache(self.version, digest)
        self.r.set(key, schema.encode(answer), ex=self.cfg.cache_ttl_s)

    def _count(self, *pairs: Any) -> None:
        """The run's judge figures (``judge:stats``): samples judged, calls made, cache hits,
        samples given up on, 429/503 answers."""
        if self.r is None or self.keys is None:
            return
        pipe = self.r.pipeline(transaction=False)
        for field, n in zip(pairs[::2], pairs[1::2], strict=True):
            if n:
                pipe.hincrby(self.keys.judge_stats, field, n)
        pipe.execute()


def judge_stats(r: redis.Redis, run: str) -> dict[str, int]:
    """``{samples, calls, cached, failures, throttled}`` of the run's judge so far (a
    field not counted yet is absent)."""
    raw = r.hgetall(Keys(run).judge_stats)
    return {k.decode(): int(v) for k, v in raw.items()}
