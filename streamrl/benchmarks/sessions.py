"""``streamrl bench sessions``: hold many multi-turn episodes open at once and measure what
each costs. Real rq rollout and verifier workers on a private Redis, the ``counter``
environment and the scripted policy with a per-turn latency, so that episodes overlap: with
``turns`` model turns an episode's session exists from its first committed turn to its last,
about ``(turns - 1) × latency`` seconds, while the workers start every episode in far less.

Figures (one JSON object):

- ``open_sessions_peak``: session keys in Redis at the fullest moment (episodes with a committed
  turn and no trajectory yet), sampled every ``sample_s``.
- ``redis_bytes_per_open_session``: ``used_memory`` at that moment minus ``used_memory`` just
  after the tasks were pushed (before any session existed), per open session: the session key,
  its TTL and the pending-entry record of the consumer group.
- ``session_key_bytes``: ``MEMORY USAGE`` of the session keys themselves (mean of a sample).
- ``worker_rss_bytes_per_episode``: growth of the rollout workers' resident memory (rq main
  and work horse) from idle to that moment, per open session.
- ``trajectories_per_s``: over the whole run, push to last group (bound by the latency).
- ``redis_commands_per_trajectory``, ``cpu_ms_per_trajectory``: every command Redis served
  and the CPU of every process (workers, Redis, this one, sampling included) over the run.
- ``lost`` / ``duplicated`` / ``dead_letters`` / ``worker_errors``: all must be 0.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis

from streamrl.config import (
    PolicyConfig,
    RolloutConfig,
    RunConfig,
    StreamConfig,
    VerifyConfig,
)
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.local.procs import self_cpu, tree_cpu, tree_rss
from streamrl.producer.produce import Producer


def _count_keys(r: redis.Redis, pattern: str) -> int:
    return sum(1 for _ in r.scan_iter(match=pattern, count=5000))


def _worker_errors(log_dir: Path) -> int:
    n = 0
    for path in log_dir.glob("*.log"):
        text = path.read_text(errors="replace")
        n += text.count("Traceback") + text.count('"level": "error"') + text.count("[error")
    return n


class _Sampler(threading.Thread):
    """Polls open sessions, Redis memory and worker RSS; keeps the fullest moment."""

    def __init__(self, url: str, pattern: str, roots: list[int], every: float):
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.pattern, self.roots, self.every = pattern, roots, every
        self.stop = threading.Event()
        self.peak: dict = {"open": -1}

    def run(self) -> None:
        while not self.stop.is_set():
            n = _count_keys(self.r, self.pattern)
            if n >= self.peak["open"]:  # the latest of the fullest moments: the longest sessions
                self.peak = {
                    "open": n,
                    "used_memory": self.r.info("memory")["used_memory"],
                    "rss": tree_rss(self.roots),
                    "keys": list(itertools.islice(self.r.scan_iter(match=self.pattern), 200)),
                }
                self.peak["key_bytes"] = [
                    self.r.memory_usage(k, samples=0) or 0 for k in self.peak["keys"]
                ]
            self.stop.wait(self.every)
        self.r.close()


def sessions_bench(
    sessions: int = 10_000,
    turns: int = 4,
    latency_s: float = 5.0,
    group_size: int = 4,
    rollout_workers: int = 1,
    verify_workers: int = 1,
    sample_s: float = 0.25,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    say = progress or (lambda m: None)
    prompts = -(-sessions // group_size)
    n = prompts * group_size
    per_worker = -(-n // rollout_workers)
    cfg = RunConfig(
        run="sessions",
        env="counter",
        group_size=group_size,
        env_options={"steps": turns - 1},
        policy=PolicyConfig(backend="scripted", wrong_rate=0.25, latency_s=latency_s),
        rollout=RolloutConfig(
            max_turns=turns + 1,
            max_concurrent=per_worker,
            read_batch=min(per_worker, 2000),
            lease_seconds=timeout_s,
        ),
        verify=VerifyConfig(lease_seconds=timeout_s),
        # heartbeats keep every held entry fresh: nothing is reclaimed while it waits
        streams=StreamConfig(claim_idle_ms=int(1000 * max(60.0, 4 * latency_s))),
    )
    env = make_env("counter", steps=turns - 1)
    with LocalPipeline(cfg) as p:
        p.start_workers(rollout_workers, verify_workers, seconds=timeout_s)
        say(f"waiting for {rollout_workers} rollout + {verify_workers} verifier workers")
        p.wait_ready(rollout_workers, verify_workers)
        assert p.procs is not None and p.url is not None
        roots = [proc.pid for _, proc in p.procs.procs[:rollout_workers]]
        time.sleep(1.0)  # the lease settles into its read loop
        rss_idle = tree_rss(roots)
        pattern = p.keys.session("*")
        assert p.server is not None and p.server.proc is not None
        every = [p.server.proc.pid] + [proc.pid for _, proc in p.procs.procs]
        p.r.config_resetstat()
        cpu0 = tree_cpu(every) + self_cpu()
        redis0 = tree_cpu(every[:1])
        t0 = time.perf_counter()
        Producer(p.r, cfg.run).from_env(env, prompts, group_size, seed=0)
        used_tasks = p.r.info("memory")["used_memory"]
        early = _count_keys(p.r, pattern)
        push_s = time.perf_counter() - t0
        say(f"pushed {n} tasks in {push_s:.1f} s ({early} sessions already open)")
        sampler = _Sampler(p.url, pattern, roots, sample_s)
        sampler.start()
        p.wait_groups(prompts, timeout=timeout_s)
        elapsed = time.perf_counter() - t0
        cpu = tree_cpu(every) + self_cpu() - cpu0
        redis_cpu = tree_cpu(every[:1]) - redis0
        sampler.stop.set()
        sampler.join()
        peak = sampler.peak
        say(f"peak {peak['open']} open sessions; {prompts} groups in {elapsed:.1f} s")
        left = _count_keys(p.r, pattern)
        dead = p.r.xlen(p.keys.dead)
        stats = p.r.info("commandstats")
        p.stop()
        acc = p.account(task_ids("counter", 0, prompts, group_size))
        errors = _worker_errors(p.dir / "logs")
    key_bytes = peak["key_bytes"] or [0]
    opened = max(1, peak["open"])
    calls = sum(v["calls"] for v in stats.values())
    return {
        "sessions": n,
        "turns": turns,
        "latency_s": latency_s,
        "rollout_workers": rollout_workers,
        "open_sessions_peak": peak["open"],
        "redis_bytes_per_open_session": round((peak["used_memory"] - used_tasks) / opened),
        "session_key_bytes": round(sum(key_bytes) / len(key_bytes)),
        "session_key_bytes_max": max(key_bytes),
        "worker_rss_bytes_per_episode": round((peak["rss"] - rss_idle) / opened),
        "worker_rss_idle_mb": round(rss_idle / 2**20, 1),
        "worker_rss_peak_mb": round(peak["rss"] / 2**20, 1),
        "sessions_open_before_push_done": early,
        "sessions_left": left,
        "seconds": round(elapsed, 2),
        "trajectories_per_s": round(n / elapsed, 1),
        "redis_commands_per_trajectory": round(calls / n, 2),
        "cpu_ms_per_trajectory": round(1000 * cpu / n, 3),
        "redis_cpu_ms_per_trajectory": round(1000 * redis_cpu / n, 3),
        "trajectories": acc.scored,
        "groups": acc.groups,
        "lost": acc.lost,
        "duplicated": acc.duplicated,
        "dead_letters": dead,
        "worker_errors": errors,
        "cpus": os.cpu_count(),
    }


# ---------------------------------------------------------------- one realistic session's bytes


def _corpus(tok, modules: tuple[str, ...], source: bool) -> list[int]:
    """Token ids of real text found wherever Python is: the standard library's module
    docstrings (prose, for what the model writes) or its source (code, for tool outputs)."""
    import importlib
    import inspect

    parts = []
    for name in modules:
        mod = importlib.import_module(name)
        parts.append(inspect.getsource(mod) if source else (mod.__doc__ or ""))
    return tok.encode("\n\n".join(parts)).ids


def realistic_session(
    model_dir: str | Path,
    prompt_tokens: int = 500,
    turns: int = 4,
    generated_tokens: int = 300,
    tool_tokens: int = 200,
    seed: int = 0,
) -> list:
    """The checkpoints of one episode as a rollout worker writes them: ``Session`` after each
    of the first ``turns - 1`` model turns (the last turn goes out with the trajectory), built
    with the model's own tokenizer and SmolLM2's ChatML template. The prompt (system + user) is
    ``prompt_tokens`` long; each turn the model writes ``generated_tokens`` (prose, then a
    function call; a plain answer in the last turn) with float32 log-probs, and each call's
    output is ``tool_tokens`` of code. Returns ``[session before the first turn, after turn
    1, ...]``."""
    import json
    import random
    import struct

    from tokenizers import Tokenizer

    from streamrl import schema, session_codec

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prose = _corpus(tok, ("argparse", "typing", "asyncio.tasks", "json", "logging"), False)
    code = _corpus(tok, ("textwrap", "shlex", "fnmatch", "glob", "base64"), True)
    rng = random.Random(seed)
    at = {"prose": 0, "code": 0}

    def take(kind: str, n: int) -> str:
        ids = prose if kind == "prose" else code
        a = at[kind]
        at[kind] = (a + n) % max(1, len(ids) - n)
        return tok.decode(ids[a : a + n])

    def chat(role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    system = "You are a helpful assistant with tools. " + take("prose", 60)
    user = take("prose", max(1, prompt_tokens - 80))
    rendered = chat("system", system) + chat("user", user) + "<|im_start|>assistant\n"
    while len(tok.encode(rendered).ids) < prompt_tokens:  # top up to the exact length
        user += " " + take("prose", 1)
        rendered = chat("system", system) + chat("user", user) + "<|im_start|>assistant\n"
    prompt = tok.encode(rendered).ids[:prompt_tokens]
    session = schema.Session(
        task_id="p0:0",
        items=[
            schema.Message(role="system", content=system),
            schema.Message(role="user", content=user),
        ],
        started_at=1764000000.0,
    )
    out = [session_codec.SESSION.decode(schema.encode(session))]
    for t in range(turns - 1):
        text = take("prose", generated_tokens - 20)
        args = json.dumps({"query": take("prose", 12)})
        items: list = [schema.Reasoning(content=text)]
        if t < turns - 1:
            items.append(schema.FunctionCall(call_id=f"call_{t}", name="lookup", arguments=args))
        written = tok.encode(text + f'<tool_call>{{"name": "lookup", "arguments": {args}}}').ids
        ids = (written + tok.encode(take("prose", 20)).ids)[:generated_tokens]
        logprobs = [
            struct.unpack("f", struct.pack("f", -rng.expovariate(2.5)))[0] for _ in ids
        ]  # what a sampler hands back: float32
        turn = schema.ModelTurn(
            index=t,
            items=items,
            prompt_token_ids=prompt,
            token_ids=ids,
            logprobs=logprobs,
            policy_version=3,
            worker="rollout-worker-1",
            seconds=1.5,
        )
        output = take("code", tool_tokens)
        session.turns.append(turn)
        session.items.extend(items)
        session.items.append(schema.FunctionCallOutput(call_id=f"call_{t}", output=output))
        session.tokens += len(ids)
        session.state = msgspec.msgpack.encode({"calls": t + 1, "found": [f"item-{t}"]})
        prompt = [*prompt, *ids, *tok.encode("<|im_end|>\n" + chat("tool", output)).ids]
        prompt += tok.encode("<|im_start|>assistant\n").ids
        out.append(session_codec.SESSION.decode(schema.encode(session)))  # a copy as it stands
    return out


def session_size_bench(
    model_dir: str | Path,
    prompt_tokens: int = 500,
    turns: int = 4,
    generated_tokens: int = 300,
    tool_tokens: int = 200,
    redis_url: str | None = None,
) -> dict:
    """Bytes of one realistic session (``realistic_session``) at each checkpoint, in three
    forms: ``plain`` msgpack (``schema.encode``, streamrl before 2026-11-25: every checkpoint
    rewrites the session), ``packed`` (``session_codec.SESSION``: every checkpoint appends a
    frame with what its turn added) and ``tokens`` (the same with the model's tokenizer, as an
    ``hf`` rollout worker writes it: text rebuilt from token ids is not stored twice); both
    packed forms are written against the task's payload, as workers write them. For each:
    the value's length, what a checkpoint sends (``frame_bytes``) and ``MEMORY USAGE`` of the key
    in a Redis (a private one unless ``redis_url``) holding the value as the COMMIT script
    leaves it. Row 0 is the session before any turn, as one frame (what an environment that
    keeps server sessions checkpoints first). ``open_session_bytes_max`` is the largest value
    (after the last committed turn); ``checkpoint_bytes_max`` the most one checkpoint of a
    completed turn writes (the first one carries the prompt too), ``turn_delta_bytes_max`` the
    most one adds to ``MEMORY USAGE``."""
    import struct
    import tempfile

    from transformers import AutoTokenizer

    from streamrl import schema, session_codec
    from streamrl.local.embedded import EmbeddedRedis
    from streamrl.policy.token_text import TokenizerText

    sessions = realistic_session(model_dir, prompt_tokens, turns, generated_tokens, tool_tokens)
    # the task as the tasks stream holds it: its payload is the first frame's dictionary
    task = schema.encode(
        schema.Task(task_id=sessions[0].task_id, prompt_id="p0", k=0, group_size=8,
                    env="lookup", input=sessions[0].items[:2])
    )  # fmt: skip
    codecs = {
        "packed": session_codec.SESSION,
        "tokens": session_codec.SessionCodec(
            TokenizerText(AutoTokenizer.from_pretrained(str(model_dir)))
        ),
    }
    with tempfile.TemporaryDirectory(prefix="streamrl-session-size-") as tmp:
        server = None if redis_url else EmbeddedRedis(tmp).start()
        r = redis.Redis.from_url(redis_url or server.url)  # type: ignore[union-attr]
        try:
            rows: list[dict] = []
            values = dict.fromkeys(codecs, b"")
            marks: dict = dict.fromkeys(codecs)
            for i, s in enumerate(sessions):
                plain = schema.encode(s)
                r.set("srl:{session-size}:plain", plain, ex=600)
                row = {"turns": i, "plain_bytes": len(plain), "plain_frame_bytes": len(plain)}
                row["redis_plain_bytes"] = r.memory_usage("srl:{session-size}:plain", samples=0)
                for form, codec in codecs.items():
                    frame, marks[form] = codec.frame(s, marks[form] if i > 1 else None, task)
                    whole = struct.unpack("<I", frame[2:6])[0] == 0  # offset 0: COMMIT replaces
                    values[form] = frame if whole else values[form] + frame
                    assert codec.decode(values[form], task) == s
                    key = f"srl:{{session-size}}:{form}"
                    r.set(key, values[form], ex=600)  # as COMMIT writes it: SET of the whole
                    row[f"{form}_bytes"] = len(values[form])
                    row[f"{form}_frame_bytes"] = len(frame)
                    row[f"redis_{form}_bytes"] = r.memory_usage(key, samples=0)
                rows.append(row)
            r.delete(*(f"srl:{{session-size}}:{f}" for f in ["plain", *codecs]))
        finally:
            r.close()
            if server is not None:
                server.stop()
    committed = rows[1:]
    forms = ["plain", *codecs]

    def growth(key: str) -> int:
        return max(b[key] - a[key] for a, b in itertools.pairwise(rows))

    return {
        "model": str(model_dir),
        "prompt_tokens": prompt_tokens,
        "turns": turns,
        "generated_tokens_per_turn": generated_tokens,
        "tool_tokens_per_turn": tool_tokens,
        "checkpoints": rows,
        "open_session_bytes_max": {f: max(c[f"redis_{f}_bytes"] for c in committed) for f in forms},
        "open_session_bytes_mean": {
            f: round(sum(c[f"redis_{f}_bytes"] for c in committed) / len(committed)) for f in forms
        },
        "checkpoint_bytes_max": {f: max(c[f"{f}_frame_bytes"] for c in committed) for f in forms},
        "turn_delta_bytes_max": {f: growth(f"redis_{f}_bytes") for f in forms},
    }
