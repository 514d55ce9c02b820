"""Re-verify stored trajectories with the current verifiers and report what changed.

Every Score carries its verifier's name and version. After a verifier changes (a bug fixed, a
leak closed), ``streamrl reverify`` scores the trajectories kept in the ``groups`` stream again
and reports, per (old version -> new version), how many rewards moved and by how much: the
drift a change in the reward definition causes, measured before anyone trains on it.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.bus.streams import xrange_all
from streamrl.envs import Environment, make_env
from streamrl.responses import items_from_json
from streamrl.verifiers.reward_functions import RewardFunctions
from streamrl.workers.context import read_config
from streamrl.workers.envs import EnvTable
from streamrl.workers.verify import VerifyFailure, verify_one

_Pairs = Iterator[tuple[schema.Trajectory, schema.Score]]


def drift_report(
    r: redis.Redis,
    run: str,
    start: str = "-",
    limit: int | None = None,
    timeout_s: float = 10.0,
    env_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    def stored() -> _Pairs:
        rows_of = (row for k in run_shards(r, run) for row in xrange_all(r, k.groups, start))
        for _eid, fields in rows_of:
            group = schema.GROUP.decode(fields[b"p"])
            for sample in group.samples:
                yield sample.trajectory, sample.score

    envs: dict[str, Environment] = {}
    cfg = read_config(r.get(Keys(run).config))
    # a mixture's names stand for its entries' environments and reward functions
    table = EnvTable(cfg, r=r) if cfg is not None else None  # r: a judge answers from its cache
    if table is not None:
        table.learn(r.get(Keys(run).mix))

    def env_for(traj: schema.Trajectory) -> Environment:
        if table is not None and traj.env in table.entries:
            return table.env(traj.env)
        env = envs.get(traj.env)
        if env is None:
            env = envs[traj.env] = make_env(traj.env, **(env_options or {}))
        return env

    def rewards_for(traj: schema.Trajectory) -> RewardFunctions | None:
        # a run scored by TRL-style reward functions is re-scored by them
        return table.reward_functions(traj.env) if table is not None else None

    return {"run": run, **_compare(stored(), env_for, limit, timeout_s, rewards_for)}


def _compare(
    pairs: _Pairs,
    env_for: Callable[[schema.Trajectory], Environment],
    limit: int | None = None,
    timeout_s: float = 10.0,
    rewards_for: Callable[[schema.Trajectory], RewardFunctions | None] = lambda _t: None,
) -> dict[str, Any]:
    """Re-score each (trajectory, old score) and count, per (old verifier -> new verifier),
    how many rewards moved and by how much."""
    rows: dict[tuple, dict[str, Any]] = defaultdict(
        lambda: {"samples": 0, "changed": 0, "failed": 0, "sum_delta": 0.0, "examples": []}
    )
    seen = 0
    for traj, old in pairs:
        if limit is not None and seen >= limit:
            break
        seen += 1
        env, rewards = env_for(traj), rewards_for(traj)
        name, version = rewards.verifier_id if rewards is not None else env.verifier_id
        row = rows[(old.verifier, old.verifier_version, name, version)]
        row["samples"] += 1
        try:
            new = verify_one(env, traj, timeout_s, retries=0, rewards=rewards)
        except VerifyFailure as e:
            row["failed"] += 1
            if len(row["examples"]) < 5:
                row["examples"].append({"task_id": traj.task_id, "failure": str(e)})
            continue
        delta = (new.reward or 0.0) - (old.reward or 0.0)
        if abs(delta) > 1e-9:
            row["changed"] += 1
            row["sum_delta"] += delta
            if len(row["examples"]) < 5:
                row["examples"].append(
                    {"task_id": traj.task_id, "old": old.reward, "new": new.reward}
                )
    report = []
    for (old_name, old_version, new_name, new_version), row in sorted(rows.items()):
        n = row["samples"]
        report.append(
            {
                "verifier": new_name,
                "from_version": f"{old_name}/{old_version}",
                "to_version": f"{new_name}/{new_version}",
                "samples": n,
                "changed": row["changed"],
                "failed": row["failed"],
                "mean_delta": round(row["sum_delta"] / n, 6) if n else 0.0,
                "examples": row["examples"],
            }
        )
    return {"samples": sum(x["samples"] for x in report), "drift": report}


# ---------------------------------------------------------------- NeMo Gym rollout rows


def rows_drift_report(
    path: str,
    env_name: str,
    env_options: dict[str, Any] | None = None,
    limit: int | None = None,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Re-score NeMo Gym rollout rows (``responses_create_params``, ``response``, ``reward``)
    with a streamrl environment's verifier and report the drift against the rows' rewards.

    Each row's recorded tool calls are replayed through the environment first (for
    ``nemo-gym``: against the resources server, in a fresh session), so a verifier that
    scores the environment's state sees the state the calls made; replayed outputs that differ
    from the recorded ones are counted. Rows that cannot be read are counted with their line.
    """
    env = make_env(env_name, **(env_options or {}))
    pairs: list[tuple[schema.Trajectory, schema.Score]] = []
    unreadable: list[str] = []
    differ = 0

    async def replay_all() -> None:
        nonlocal differ
        try:
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if limit is not None and len(pairs) >= limit:
                        break
                    if not line.strip():
                        continue
                    try:
                        task, output, old = _row_sample(line, env_name, n)
                    except ValueError as e:
                        unreadable.append(f"line {n}: {e}")
                        continue
                    traj, changed = await _replay(env, task, output)
                    differ += changed
                    pairs.append((traj, old))
        finally:
            await env.aclose()

    asyncio.run(replay_all())
    report = _compare(iter(pairs), lambda _t: env, None, timeout_s)
    return {
        "rows": path,
        **report,
        "replayed_outputs_differ": differ,
        "unreadable": len(unreadable),
        "unreadable_examples": unreadable[:5],
    }


def _row_sample(
    line: bytes, env_name: str, n: int
) -> tuple[schema.Task, list[schema.Item], schema.Score]:
    from streamrl.responses import row_to_prompt

    items, data, pid = row_to_prompt(line)
    row = json.loads(line)
    response = row.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise ValueError("no response.output: not a rollout row")
    reward = row.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"no numeric reward (reward={reward!r})")
    output = items_from_json(response["output"], "response.output")
    pid = pid or f"row-{n:07d}"
    task = schema.Task(
        task_id=f"{pid}:0", prompt_id=pid, k=0, group_size=1, env=env_name, input=items, data=data
    )
    meta = row.get("streamrl") if isinstance(row.get("streamrl"), dict) else {}
    old = schema.Score(
        task_id=task.task_id,
        prompt_id=pid,
        k=0,
        reward=float(reward),
        verifier=str(meta.get("verifier") or "rows"),
        verifier_version=str(meta.get("verifier_version") or "recorded"),
    )
    return task, output, old


async def _replay(
    env: Environment, task: schema.Task, output: list[schema.Item]
) -> tuple[schema.Trajectory, int]:
    state = await env.areset(task)
    recorded = {i.call_id: i.output for i in output if isinstance(i, schema.FunctionCallOutput)}
    differ = 0
    for item in output:
        if isinstance(item, schema.FunctionCall):
            result = await env.acall_tool(task, state, item)
            state = result.state
            if item.call_id in recorded and recorded[item.call_id] != result.output:
                differ += 1
            if result.done:  # as in the episode: nothing after the call that ended it ran
                break
    traj = schema.Trajectory(
        task_id=task.task_id,
        prompt_id=task.prompt_id,
        k=0,
        group_size=1,
        env=task.env,
        items=[*task.input, *output],
        n_input=len(task.input),
        turns=[],
        status="completed",
        state=env.encode_state(state),
        data=task.data,
    )
    return traj, differ
