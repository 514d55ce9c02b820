"""Bad input ends as a dead letter or a failure with a readable reason, and the rest of the run
completes: malformed task rows, undecodable stream entries, a model's broken tool call, a tool
that raises, a verifier that raises or hangs."""

from __future__ import annotations

import json

import msgspec

from streamrl import schema
from streamrl.config import PolicyConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids, xrange_all
from streamrl.producer.produce import Producer
from streamrl.schema import FunctionCallOutput
from tests.support.waiting import wait_for


def _dead(p) -> list[schema.DeadLetter]:
    return [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.dead)]


def test_bad_rows_and_entries_are_dead_lettered_and_the_rest_completes(
    redis_url, subprocess_env, tmp_path
):
    rows = [
        {"prompt": "The counter starts at 1. Add 2.", "start": 1, "numbers": [2], "id": "ok1"},
        "{not json",
        {"question": "no prompt field"},
        {"responses_create_params": {"input": [{"type": "message", "role": "robot"}]}},
        [1, 2, 3],
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
            },
            "start": 5,
            "numbers": [1],
            "id": "ok2",
        },
        {"prompt": "missing verifier data", "id": "broken-task"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig(run="bad", env="counter", group_size=2, env_options={"steps": 1})
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        res = Producer(p.r, "bad").from_jsonl(data, "counter", 2)
        assert res.prompts == 3 and len(res.rejected) == 4
        assert any("rows.jsonl:2: not JSON" in x for x in res.rejected)
        assert any("rows.jsonl:3: no prompt" in x for x in res.rejected)
        assert any("rows.jsonl:4: input item 0" in x for x in res.rejected)
        assert any("rows.jsonl:5: expected a JSON object" in x for x in res.rejected)
        # garbage written straight to the streams, as a buggy producer or rollout might
        p.r.xadd(p.keys.tasks, {"id": "junk:0", "p": b"\xc1\xff not msgpack"})
        p.r.xadd(
            p.keys.rollouts,
            {
                "id": "junk2:0",
                "p": schema.encode(
                    schema.Score(task_id="junk2:0", prompt_id="junk2", k=0, reward=1.0)
                ),
            },
        )
        p.start_workers(rollout=1, verify=1)
        # ok1, ok2 complete; the groups of broken-task (reset fails: no 'start'), junk and
        # junk2 are dropped: 5 groups settle in all
        p.wait_groups(5)
        acc = p.account({"ok1:0", "ok1:1", "ok2:0", "ok2:1"})
        dead = _dead(p)
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == 2, [d.reason for d in dead]
    assert p.stat("groups_dropped") == 3
    reasons = [(d.stage, d.task_id, d.reason) for d in dead]
    assert sum(1 for s, _, _ in reasons if s == "produce") == 4
    assert any(s == "rollout" and t == "junk:0" and "undecodable task" in r for s, t, r in reasons)
    assert any(
        s == "verify" and t == "junk2:0" and "undecodable trajectory" in r for s, t, r in reasons
    )
    assert any(
        s == "verify"
        and t.startswith("broken-task")
        and "rollout failed: environment error" in r
        and "KeyError" in r
        for s, t, r in reasons
    )


def test_broken_tool_calls_and_raising_tools_become_error_outputs(
    redis_url, subprocess_env, tmp_path
):
    cfg = RunConfig(
        run="tools",
        env="counter",
        group_size=2,
        env_options={"steps": 3, "raise_on": 7},
        policy=PolicyConfig(malformed_rate=0.5),
    )
    env = make_env("counter", steps=3)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        Producer(p.r, "tools").from_env(env, 24, 2, seed=2)
        p.wait_groups(24)
        acc = p.account(task_ids("counter", 2, 24, 2))
        trajs = p.trajectories()
    assert acc.lost == 0 and acc.groups == 24
    outputs = [i.output for t in trajs for i in t.items if isinstance(i, FunctionCallOutput)]
    assert any(o.startswith("error: arguments are not valid JSON") for o in outputs)
    assert any(
        o.startswith("error: tool add raised RuntimeError: the add tool broke on 7")
        for o in outputs
    )
    # a broken call costs the model a turn but the episode goes on to its answer
    assert all(t.status == "completed" for t in trajs)


def test_verifier_that_raises_or_hangs_is_a_failure_not_a_zero(redis_url, subprocess_env, tmp_path):
    for env_spec in (
        "tests.support.envs:HangingVerifyCounter",
        "tests.support.envs:RaisingVerifyCounter",
    ):
        run = env_spec.rsplit(":", 1)[1]
        cfg = RunConfig(
            run=run,
            env=env_spec,
            group_size=2,
            env_options={"steps": 1},
            verify=VerifyConfig(timeout_s=0.3, retries=1, batch=8),
            streams=StreamConfig(claim_idle_ms=2000, heartbeat_s=0.2),
        )
        env = make_env(env_spec, steps=1)
        with LocalPipeline(
            cfg, url=redis_url, directory=tmp_path / run, worker_env=subprocess_env
        ) as p:
            p.start_workers(rollout=1, verify=1)
            Producer(p.r, run).from_env(env, 20, 2, seed=4, env_spec=env_spec)
            p.wait_groups(20, timeout=120)
            dead = _dead(p)
            scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
            completed, dropped = p.stat("groups_completed"), p.stat("groups_dropped")
            groups = [schema.GROUP.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.groups)]
        starts = {
            t.prompt_id: t.data["start"] for g in groups for t in [s.trajectory for s in g.samples]
        }
        bad = (lambda s: s % 5 == 0) if "Hanging" in env_spec else (lambda s: s % 2 == 1)
        assert dropped > 0 and completed > 0 and completed + dropped == 20
        assert not any(bad(s) for s in starts.values()), "a failed sample was trained on"
        failures = [s for s in scores if s.failure]
        assert failures and all(s.reward is None for s in failures)
        expect = "did not finish within 0.3 s" if "Hanging" in env_spec else "ZeroDivisionError"
        assert all(expect in d.reason and "after 2 attempts" in d.reason for d in dead)
        assert len(dead) == len(failures)


def test_policy_outage_dead_letters_after_max_deliveries_never_scores(
    redis_url, subprocess_env, tmp_path
):
    """A backend that cannot answer (connection refused) is infrastructure: the task stays
    pending, is redelivered after claim_idle_ms, and after max_deliveries is dead-lettered
    with its reason. No score of 0 is ever written."""
    cfg = RunConfig(
        run="outage",
        env="counter",
        group_size=2,
        policy=PolicyConfig(
            backend="openai",
            base_url="http://127.0.0.1:9/v1",
            model="m",
            options={"retries": 0, "down_wait_s": 0},
        ),
        streams=StreamConfig(claim_idle_ms=300, heartbeat_s=0.1, max_deliveries=3),
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        Producer(p.r, "outage").from_env(make_env("counter"), 3, 2, seed=1)
        p.wait_groups(3, timeout=120)
        dead = _dead(p)
        assert p.stat("groups_completed") == 0 and p.stat("groups_dropped") == 3
        assert p.r.xlen(p.keys.scored) == 0
    assert len(dead) == 6
    assert all(d.stage == "rollout" and "delivered 4 times" in d.reason for d in dead)


def test_impossible_entries_are_dead_lettered_by_the_first_stage_and_the_run_goes_on(
    redis_url, subprocess_env, tmp_path
):
    """Entries a buggy producer or rollout could write: a k outside [0, group_size), a
    group_size of 0, an empty task id, and two samples of one prompt that disagree on the group
    size. Each is dead-lettered with its reason by the stage that reads it first, and the
    prompts after them still complete."""
    cfg = RunConfig(run="imp", env="counter", group_size=2, env_options={"steps": 1})
    env = make_env("counter", steps=1)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        producer = Producer(p.r, "imp")
        producer.from_env(env, 2, 2, seed=3)
        p.wait_groups(2)
        real = msgspec.to_builtins(p.trajectories()[0], builtin_types=(bytes,))
        task = {"v": 1, "env": "counter", "input": [], "data": {}}
        raw_tasks = [
            {**task, "task_id": "k5:5", "prompt_id": "k5", "k": 5, "group_size": 2},
            {**task, "task_id": "zero:0", "prompt_id": "zero", "k": 0, "group_size": 0},
            {**task, "task_id": "", "prompt_id": "noid", "k": 0, "group_size": 2},
        ]
        for t in raw_tasks:
            p.r.xadd(p.keys.tasks, {"id": t["task_id"], "p": msgspec.msgpack.encode(t)})
        for tid, k, size in [("junk:3", 3, 2), ("mix:0", 0, 2), ("mix:1", 1, 3)]:
            traj = {**real, "task_id": tid, "prompt_id": tid.split(":")[0], "k": k}
            traj["group_size"] = size
            p.r.xadd(p.keys.rollouts, {"id": tid, "p": msgspec.msgpack.encode(traj)})
        wait_for(lambda: p.r.xlen(p.keys.dead) >= 5, timeout=60, what="5 dead letters")
        producer.from_env(env, 4, 2, seed=3)  # prompts 2 and 3: the stages still work
        wait_for(lambda: p.stat("groups_completed") >= 4, timeout=60, what="4 groups completed")
        dead = {(d.stage, d.task_id): d.reason for d in _dead(p)}
        completed = {g.prompt_id for g in (p.trajectories())}
        acc = p.account(task_ids("counter", 3, 4, 2))
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == 4, dead
    assert "mix" not in completed, "a group with a sample that did not fit was trained on"
    assert "k must be in [0, group_size=2), got 5" in dead[("rollout", "k5:5")]
    assert "group_size must be at least 1, got 0" in dead[("rollout", "zero:0")]
    assert any(
        s == "rollout" and "task_id and prompt_id must be non-empty" in r
        for (s, _), r in dead.items()
    )
    assert "k must be in [0, group_size=2), got 3" in dead[("verify", "junk:3")]
    assert "impossible sample: k=1, group_size=3" in dead[("verify", "mix:1")]
    assert len(dead) == 5
