"""Rollout workers SIGKILLed inside the windows that matter, against the stateful test resources
server, and the figures read from the server's own log: the exactly-once check of
tests/workers/test_nemo_gym_exactly_once.py and of bench/nemo_gym_kills.py.

The work horse kills itself at the fault points of ``streamrl.envs._failpoints``
(``after_open``: ``/seed_session`` answered, not yet checkpointed; ``after_tool_send``: a tool
call answered, not yet checkpointed), the first hits or at random from a seed. Every row's
scripted agent is right, so every sample must score 1.0; the figures say where that failed:

- ``calls_applied_twice``: calls the server applied beyond the trajectory's own, in the session
  that was verified;
- ``sessions_not_as_recorded``: verified sessions whose applied calls differ from the
  trajectory's calls;
- ``sessions_leaked``: server sessions never verified nor closed (``..._with_calls``: holding
  applied calls);
- ``scored``, ``scored_0``, ``dropped`` (dead letters), ``drained``;
- from the journals: ``samples_replayed_into_a_fresh_session``, ``lost_opens`` (seeds whose
  answer died with a worker and that could not be closed by id: the sessions they made, if
  any, cannot be found), ``verified_attempts`` (scored samples by the attempt verified);
- ``attempt_mismatch``: verified typed sessions seeded under another attempt than the one the
  journal records; ``sessions_seeded_twice``; ``sessions_typed`` (seeded with 0.7's body).

Only the trajectory's decoded state is read (``seed_response.session_id``, and the journal
when there is one), as a plain msgpack map, so the figures can be taken of any version.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from streamrl import schema
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.producer.produce import Producer
from streamrl.schema import FunctionCall
from tests.support.nemo_gym import counter_row, sessions, write_rows

FAILPOINTS = "STREAMRL_ENV_FAILPOINTS"
FAILPOINT_DIR = "STREAMRL_ENV_FAILPOINT_DIR"
FAILPOINT_P = "STREAMRL_ENV_FAILPOINT_P"
FAILPOINT_SEED = "STREAMRL_ENV_FAILPOINT_SEED"


def kill_rows(prompts: int, seed: int = 0) -> list[dict[str, Any]]:
    """Counter rows of three increments and a read: a repeated increment moves the final
    count (``/verify`` then says 0) and shows in the read's answer."""
    rng = random.Random(seed)
    read = [{"name": "get_counter_value", "arguments": "{}"}]
    return [
        counter_row(f"k{i:04d}", rng.randint(0, 50), [rng.randint(1, 9) for _ in range(3)],
                    extra_calls=read)
        for i in range(prompts)
    ]  # fmt: skip


def kill_run(
    redis_url: str,
    server_url: str,
    directory: Path,
    worker_env: dict[str, str],
    *,
    prompts: int = 24,
    faults: str = "after_open:1,after_tool_send:3",
    p: float = 1.0,
    seed: int = 0,
    rollout_workers: int = 1,
    run: str = "ng-kills",
    timeout_s: float = 240.0,
) -> dict[str, Any]:
    """One run of ``prompts`` x 4 samples under the given fault points; the figures."""
    fault_dir = directory / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **worker_env,
        FAILPOINTS: faults,
        FAILPOINT_DIR: str(fault_dir),
        FAILPOINT_P: str(p),
        FAILPOINT_SEED: str(seed),
    }
    rows = write_rows(directory / "rows.jsonl", kill_rows(prompts, seed))
    cfg = RunConfig(
        run=run,
        env="nemo-gym",
        group_size=4,
        env_options={"base_url": server_url},
        policy=PolicyConfig(wrong_rate=0.0, latency_s=0.02),
        rollout=RolloutConfig(lease_seconds=30, max_concurrent=16),
        verify=VerifyConfig(retries=1, timeout_s=30),
        streams=StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30),
    )
    before = set(sessions(server_url))
    drained = True
    with LocalPipeline(cfg, url=redis_url, directory=directory / "run", worker_env=env) as pipe:
        Producer(pipe.r, run).from_jsonl(rows, "nemo-gym", 4)
        pipe.start_workers(rollout=rollout_workers, verify=1)
        try:
            pipe.wait_groups(prompts, timeout=timeout_s)
        except TimeoutError:
            drained = False
        samples = [
            s
            for _, f in xrange_all(pipe.r, pipe.keys.groups)
            for s in schema.GROUP.decode(f[b"p"]).samples
        ]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(pipe.r, pipe.keys.dead)]
        completed, dropped = pipe.stat("groups_completed"), pipe.stat("groups_dropped")
    server = {k: v for k, v in sessions(server_url).items() if k not in before}
    return _figures(samples, dead, server, fault_dir, completed, dropped, drained, prompts, seed)


def _calls(traj: schema.Trajectory) -> list[str]:
    """The trajectory's calls as the test server logs them."""
    out = []
    for item in traj.items[traj.n_input :]:
        if isinstance(item, FunctionCall):
            args = json.loads(item.arguments or "{}")
            out.append(f"{item.name}:{args['count']}" if "count" in args else item.name)
    return out


def _figures(samples, dead, server, fault_dir, completed, dropped, drained, prompts, seed):
    verified: set[str] = set()
    twice = not_as_recorded = scored_0 = replayed = lost = attempt_mismatch = 0
    attempts: Counter[int] = Counter()
    for s in samples:
        state = msgspec.msgpack.decode(s.trajectory.state)
        answer = state.get("seed_response") or {}
        sid = answer.get("session_id") or answer.get("resources_session_id")
        record = server.get(sid)
        if record is None:
            not_as_recorded += 1
            continue
        verified.add(sid)
        expected = _calls(s.trajectory)
        twice += max(0, len(record["calls"]) - len(expected))
        not_as_recorded += record["calls"] != expected or record["verifies"] != 1
        scored_0 += s.score.reward == 0.0
        journal = state.get("journal") or {}
        replayed += journal.get("attempt", 0) > 0
        lost += journal.get("lost", 0)
        attempts[journal.get("attempt", 0)] += 1
        episode = record.get("episode_id")  # a typed seed's: the attempt the server was told
        if episode is not None and episode.get("attempt") != journal.get("attempt", 0):
            attempt_mismatch += 1
    leaked = [r for sid, r in server.items() if sid not in verified and not r.get("closed")]
    kills = Counter(path.read_text().split()[0] for path in fault_dir.iterdir())
    return {
        "seed": seed,
        "prompts": prompts,
        "samples": 4 * prompts,
        "kills": dict(kills),
        "drained": drained,
        "groups_completed": completed,
        "groups_dropped": dropped,
        "scored": len(samples),
        "scored_0": scored_0,
        "dropped": len(dead),
        "dead_letter_reasons": sorted({d.reason[:160] for d in dead})[:5],
        "calls_applied_twice": twice,
        "sessions_not_as_recorded": not_as_recorded,
        "sessions_opened": len(server),
        "sessions_closed": sum(1 for r in server.values() if r.get("closed")),
        "sessions_leaked": len(leaked),
        "sessions_leaked_with_calls": sum(1 for r in leaked if r["calls"]),
        "samples_replayed_into_a_fresh_session": replayed,
        "lost_opens": lost,
        # the scored samples by the attempt (server session, from 0) that was verified, and
        # the verified typed sessions whose seed named another attempt
        "verified_attempts": {str(k): n for k, n in sorted(attempts.items())},
        "attempt_mismatch": attempt_mismatch,
        "sessions_seeded_twice": sum(1 for r in server.values() if r.get("seeds", 0) > 1),
        "sessions_typed": sum(1 for r in server.values() if r.get("episode_id")),
    }


def random_seed() -> int:
    """The seed of the random kills: ``STREAMRL_KILL_SEED`` to rerun one, else a new one."""
    return int(os.environ.get("STREAMRL_KILL_SEED") or random.randrange(1 << 30))


# ---------------------------------------------------------------- mode=run (environment server)


def run_mode_rows(prompts: int, seed: int = 0, extra: list[dict[str, Any]] | None = None):
    return kill_rows(prompts, seed) + list(extra or [])


def run_mode_kill_run(
    redis_url: str,
    server_url: str,
    endpoint: str,
    directory: Path,
    worker_env: dict[str, str],
    rows: list[dict[str, Any]],
    *,
    faults: str = "after_policy_turn:2",
    p: float = 1.0,
    seed: int = 0,
    run: str = "ng-run-kills",
    group_size: int = 2,
    timeout_s: float = 240.0,
    sessions_url: str | None = "",
) -> dict[str, Any]:
    """``rows`` x ``group_size`` samples through an environment server's ``/run`` (mode=run;
    the worker serves its policy at ``endpoint``), the work horse SIGKILLed at the fault points
    (``after_policy_turn``: a model turn answered to the server's agent, the episode's /run in
    flight); the figures, from the resources server's own log (``GET /_sessions`` at
    ``sessions_url``, default ``server_url``: the test server or bench/nemo_gym_pypi/servers.py's
    counter; None: no log to read) and the scored trajectories."""
    if sessions_url == "":
        sessions_url = server_url
    log = (lambda: sessions(sessions_url)) if sessions_url else dict
    fault_dir = directory / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {**worker_env, FAILPOINTS: faults, FAILPOINT_DIR: str(fault_dir),
           FAILPOINT_P: str(p), FAILPOINT_SEED: str(seed)}  # fmt: skip
    path = write_rows(directory / "rows.jsonl", rows)
    cfg = RunConfig(
        run=run,
        env="nemo-gym",
        group_size=group_size,
        env_options={
            "base_url": server_url,
            "mode": "run",
            "policy_endpoint": endpoint,
            "retries": 2,
            "run_timeout_s": 60,
        },
        policy=PolicyConfig(wrong_rate=0.0, options={"token_vocab": 64}),
        rollout=RolloutConfig(lease_seconds=30, max_concurrent=16),
        verify=VerifyConfig(retries=1, timeout_s=30),
        streams=StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30),
    )
    before = set(log())
    drained = True
    with LocalPipeline(cfg, url=redis_url, directory=directory / "run", worker_env=env) as pipe:
        Producer(pipe.r, run).from_jsonl(path, "nemo-gym", group_size)
        pipe.start_workers(rollout=1, verify=1)
        try:
            pipe.wait_groups(len(rows), timeout=timeout_s)
        except TimeoutError:
            drained = False
        samples = [
            s
            for _, f in xrange_all(pipe.r, pipe.keys.groups)
            for s in schema.GROUP.decode(f[b"p"]).samples
        ]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(pipe.r, pipe.keys.dead)]
        scored = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(pipe.r, pipe.keys.scored)]
        completed, dropped = pipe.stat("groups_completed"), pipe.stat("groups_dropped")
    server = {k: _record(v) for k, v in log().items() if k not in before}
    by_episode = {
        (r["episode_id"]["rollout_id"], r["episode_id"]["attempt"]): r
        for r in server.values()
        if r.get("episode_id")
    }
    twice = not_as_recorded = scored_0 = untokened = turns = 0
    attempts: Counter[int] = Counter()
    for s in samples:
        t = s.trajectory
        state = msgspec.msgpack.decode(t.state)
        attempt = (state.get("journal") or {}).get("attempt", 0)
        attempts[attempt] += 1
        record = by_episode.get((episode_rollout_id(t.task_id), attempt))
        expected = _calls(t)
        if by_episode and (
            record is None or record["verifies"] != 1 or record["calls"] != expected
        ):
            not_as_recorded += 1
        if record is not None:
            twice += max(0, len(record["calls"]) - len(expected))
        scored_0 += s.score.reward == 0.0
        turns += len(t.turns)
        untokened += not t.turns or any(not turn.token_ids for turn in t.turns)
    if not by_episode:  # legacy seeds (or no log): the server does not know the episodes
        not_as_recorded = twice = None
    kills = Counter(path.read_text().split()[0] for path in fault_dir.iterdir())
    ids = [s.task_id for s in scored if s.reward is not None]
    return {
        "seed": seed,
        "samples": group_size * len(rows),
        "kills": dict(kills),
        "drained": drained,
        "groups_completed": completed,
        "groups_dropped": dropped,
        "scored": len(samples),
        "scored_0": scored_0,
        "scored_twice": len(ids) - len(set(ids)),
        "dead_letters": {d.task_id: d.reason[:200] for d in dead},
        "dead_letter_kinds": sorted({d.kind for d in dead}),
        "calls_applied_twice": twice,
        "sessions_not_as_recorded": not_as_recorded,
        "samples_without_tokens": untokened,
        "model_turns_recorded": turns,
        "mean_reward": sum(s.score.reward or 0 for s in samples) / max(1, len(samples)),
        "sessions_seeded": len(server),
        "sessions_closed": sum(1 for r in server.values() if r.get("closed")),
        "sessions_leaked": sum(1 for r in server.values() if not r.get("closed")),
        "sessions_verified": sum(1 for r in server.values() if r["verifies"]),
        "sessions_leaked_with_calls": sum(
            1 for r in server.values() if not r.get("closed") and r["calls"]
        ),
        "verified_attempts": {str(k): n for k, n in sorted(attempts.items())},
    }


def _record(r: dict[str, Any]) -> dict[str, Any]:
    """A session record of either server, its calls as the test server logs them (the PyPI
    counter logs each increment's count)."""
    calls = [f"increment_counter:{c}" if isinstance(c, int) else c for c in r["calls"]]
    return {**r, "calls": calls}


def episode_rollout_id(task_id: str) -> str:
    from streamrl.envs._nemo_gym_wire import episode_id

    return episode_id(task_id, 0)["rollout_id"]
