"""The nemo-gym environment through the whole pipeline, against a resources server written the
way NeMo Gym writes them (tests/support/nemo_gym_server.py), running in its own process:
real rq workers, real Redis, real HTTP.

Checked against the server's own state: every session was seeded once, the tools changed it
as the model asked, a worker killed mid-episode is replaced by one that carries on the same
server session, and every failure of the server ends as a dead letter naming the HTTP status
and the body, never as a reward."""

from __future__ import annotations

import json

import pytest

from streamrl import schema, session_codec
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer
from streamrl.schema import FunctionCallOutput
from streamrl.workers import leases
from tests.support.cli import run_cli
from tests.support.nemo_gym import by_label, counter_row, resources_server, write_rows
from tests.support.waiting import wait_for

FAST = StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=5)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with resources_server(tmp_path_factory.mktemp("nemo-gym-server")) as url:
        yield url


def _dead(p) -> dict[str, schema.DeadLetter]:
    out = {}
    for _, f in xrange_all(p.r, p.keys.dead):
        d = schema.DEAD_LETTER.decode(f[b"p"])
        out[d.task_id.split(":")[0]] = d
    return out


def test_rollouts_train_on_the_server_and_its_failures_are_dead_letters(
    server_url, redis_url, subprocess_env, tmp_path
):
    kv_miss = [{"name": "kv_get", "arguments": json.dumps({"key": "missing"})}]
    kv_hit = [
        {"name": "kv_set", "arguments": json.dumps({"key": "k", "value": "v"})},
        {"name": "kv_get", "arguments": json.dumps({"key": "k"})},
    ]
    good = {
        "ok1": counter_row("ok1", 3, [4, 5]),
        "ok2": counter_row("ok2", 0, [1], extra_calls=kv_hit),
        "miss": counter_row("miss", 7, [2], extra_calls=kv_miss),  # a 4xx goes to the model
        "flaky": counter_row("flaky", 1, [1], fault="tool_flaky"),  # one 503, then retried
    }
    bad = {
        "tool5xx": counter_row("tool5xx", 1, [1], fault="tool_5xx"),
        "slow": counter_row("slow", 1, [1], fault="tool_slow", slow_s=5.0),
        "seed5xx": counter_row("seed5xx", 1, [1], fault="seed_5xx"),
        "verify5xx": counter_row("verify5xx", 1, [1], fault="verify_5xx"),
        "malformed": counter_row("malformed", 1, [1], fault="verify_malformed"),
        "noreward": counter_row("noreward", 1, [1], fault="verify_no_reward"),
        "masked": counter_row("masked", 1, [1], fault="verify_masked"),
    }
    good["ok2"]["responses_create_params"]["parallel_tool_calls"] = False
    rows = write_rows(tmp_path / "rows.jsonl", [*good.values(), *bad.values()])
    cfg = RunConfig(
        run="ng",
        env="nemo-gym",
        group_size=2,
        env_options={"base_url": server_url, "retries": 1, "timeout_s": 0.5, "backoff_s": 0.01},
        policy=PolicyConfig(wrong_rate=0.0),
        verify=VerifyConfig(retries=1, timeout_s=10),
        streams=FAST,
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        res = Producer(p.r, "ng").from_jsonl(rows, "nemo-gym", 2)
        assert res.prompts == len(good) + len(bad) and not res.rejected
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(len(good) + len(bad), timeout=120)
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        trajs = {t.task_id: t for t in p.trajectories()}
        dead = _dead(p)
        completed, dropped = p.stat("groups_completed"), p.stat("groups_dropped")
        status = collect(p.r, "ng")
    server = by_label(server_url)

    assert (completed, dropped) == (len(good), len(bad)), {k: d.reason for k, d in dead.items()}
    # no failure of the server was ever scored: the only rewards are the good rows' 1.0s
    rewards = [s.reward for s in scores if s.reward is not None]
    assert rewards == [1.0] * (2 * len(good))
    for s in scores:
        if s.reward is not None:
            assert s.verifier == "nemo-gym"
            assert s.info["counter"] == s.info["expected_count"]
            assert s.components["tool_calls"] == s.info["tool_calls"]
    # the server's state: one session per sample, seeded once, changed as the calls asked
    for label, row in good.items():
        sessions = server[label]
        assert len(sessions) == 2, sessions
        for rec in sessions:
            assert rec["seeds"] == 1 and rec["verifies"] == 1
            assert rec["count"] == row["expected_count"]
    assert server["ok2"][0]["kv"] == {"k": "v"}
    miss = trajs["miss:0"]
    outputs = [i.output for i in miss.items if isinstance(i, FunctionCallOutput)]
    assert "no key 'missing'" in outputs[-1] and miss.status == "completed"
    assert server["flaky"][0]["counter_failures"] == 1
    # every failure is a dead letter that says what the server answered
    expect = {
        "tool5xx": ("rollout", "HTTP 503 from POST /increment_counter", "overloaded"),
        "slow": ("rollout", "timeout on POST /increment_counter", "timeout_s=0.5"),
        "seed5xx": ("rollout", "HTTP 503 from POST /seed_session", "seeding is down"),
        "verify5xx": ("verify", "HTTP 502 from POST /verify", "the judge is down"),
        "malformed": ("verify", "malformed answer from POST /verify", "<html>proxy error"),
        "noreward": ("verify", "malformed answer from POST /verify", "no numeric reward"),
        "masked": ("verify", "/verify masked the sample", "the judge timed out"),
    }
    for label, (stage, what, body) in expect.items():
        d = dead[label]
        assert d.stage == stage and what in d.reason and body in d.reason, (label, d.reason)
    # a masked sample is an environment failure of its kind, asked once (not retried), and
    # counted by kind; every other dead letter has no kind
    assert dead["masked"].kind == "masked:judge_unavailable"
    assert {d.kind for k, d in dead.items() if k != "masked"} == {""}
    assert [r["verifies"] for r in server["masked"]] == [1, 1]
    assert status["masked"] == {"judge_unavailable": 2}
    masked = [s for s in scores if s.failure_kind]
    assert [s.failure_kind for s in masked] == ["masked:judge_unavailable"] * 2
    assert all(s.reward is None for s in masked)
    # a sample dead-lettered at the verifier stage releases its session: closed on the server
    for label in ("verify5xx", "malformed", "noreward", "masked"):
        assert [r["closed"] for r in server[label]] == [True, True], (label, server[label])
    assert "after 2 attempts" in dead["tool5xx"].reason
    assert not {"ok1", "ok2", "miss", "flaky"} & set(dead)

    _export_and_reverify(server_url, redis_url, subprocess_env, tmp_path, scores)


def _export_and_reverify(server_url, redis_url, subprocess_env, tmp_path, scores) -> None:
    """The run's rollouts as NeMo Gym rows, re-scored through the server: no drift; rows whose
    reward or recorded calls were changed show up as drift; a row that is not a rollout is
    counted, not fatal."""
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": "ng"}
    exported = tmp_path / "rollouts.jsonl"
    res = run_cli(["export", "--format", "nemo-gym", "-o", str(exported)], env)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    assert len(rows) == 8 and all(r["reward"] == 1.0 for r in rows)
    row = rows[0]
    assert row["counter"] == row["expected_count"] and row["tool_calls"] >= 1  # /verify's fields
    assert row["response"]["output"][0]["type"] == "function_call"
    assert "reference_output" not in row
    # what NeMo Gym's own tooling keys rollouts by: the dataset row's id, a task index per
    # prompt, a rollout index per sample; and the request's real parallel_tool_calls
    assert {r["id"] for r in rows} == {"ok1", "ok2", "miss", "flaky"}
    keys = sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows)
    assert keys == [(t, k) for t in range(4) for k in range(2)]
    assert len({(r["id"], r["_ng_task_index"]) for r in rows}) == 4
    parallel = {r["id"]: r["response"]["parallel_tool_calls"] for r in rows}
    assert parallel == {"ok1": True, "ok2": False, "miss": True, "flaky": True}

    def reverify(path):
        argv = ["reverify", "--nemo-gym-rows", str(path), "--env-option", f"base_url={server_url}"]
        out = run_cli(argv, env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    same = reverify(exported)
    (drift,) = same["drift"]
    assert (drift["samples"], drift["changed"], drift["failed"]) == (8, 0, 0), same
    assert same["replayed_outputs_differ"] == 0 and same["unreadable"] == 0
    rows[0]["reward"] = 0.0  # a recorded reward the server disagrees with
    calls = [o for o in rows[1]["response"]["output"] if o["type"] == "function_call"]
    calls[0]["arguments"] = json.dumps({"count": 1000})  # the replayed counter ends elsewhere
    tampered = tmp_path / "tampered.jsonl"
    lines = [json.dumps(r) for r in rows] + [json.dumps({"prompt": "no response here"})]
    tampered.write_text("\n".join(lines) + "\n")
    changed = reverify(tampered)
    (drift,) = changed["drift"]
    assert drift["samples"] == 8 and drift["changed"] == 2, changed
    assert drift["mean_delta"] == 0.0  # one went up by 1, one down by 1
    assert changed["unreadable"] == 1 and "not a rollout row" in changed["unreadable_examples"][0]


def _session(p, task_id: str) -> schema.Session | None:
    """The task's session as its worker checkpointed it (against the task's payload)."""
    raw = p.r.get(p.keys.session(task_id))
    if not raw:
        return None
    # the task's entries on the stream (a redelivered task can have more than one; they carry
    # the same payload): the session was written against that payload
    tasks = {f[b"p"] for _, f in p.r.xrange(p.keys.tasks) if f.get(b"id") == task_id.encode()}
    assert len(tasks) == 1, f"{len(tasks)} different payloads for {task_id}"
    return session_codec.SESSION.decode(raw, tasks.pop())


def test_an_episode_resumes_on_another_worker_in_the_same_server_session(
    server_url, redis_url, subprocess_env, tmp_path
):
    """Kill the rollout worker right after it checkpointed turn 1 (it is then waiting on the
    slow policy): another worker must carry on with the same cookie, so the server sees one
    session, seeded once, with every increment exactly once."""
    adds = [2, 3, 4, 5]
    rows = write_rows(tmp_path / "rows.jsonl", [counter_row("resume", 10, adds)])
    cfg = RunConfig(
        run="ng-resume",
        env="nemo-gym",
        group_size=1,
        env_options={"base_url": server_url},
        policy=PolicyConfig(wrong_rate=0.0, latency_s=1.5),
        rollout=RolloutConfig(lease_seconds=60),
        streams=FAST,
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        Producer(p.r, cfg.run).from_jsonl(rows, "nemo-gym", 1)
        (first,) = p.procs.start(ROLLOUT_QUEUE, 1)
        p.procs.start(VERIFY_QUEUE, 1)
        leases.top_up(p.r, ROLLOUT_QUEUE, cfg.run)
        leases.top_up(p.r, VERIFY_QUEUE, cfg.run)
        # turn 1 checkpointed with its call's output: the call is confirmed and the worker
        # waits on the slow policy (a checkpoint taken while the call was in flight is not
        # enough: killed then, the episode rightly replays into a fresh server session)
        wait_for(
            lambda: (
                (s := _session(p, "resume:0")) is not None
                and len(s.turns) >= 1
                and any(isinstance(i, schema.FunctionCallOutput) for i in s.items)
            ),
            what="the first checkpoint after a confirmed call",
            timeout=60,
        )
        p.procs.kill(first)
        first.wait()
        before = by_label(server_url)["resume"]
        p.procs.start(ROLLOUT_QUEUE, 1)
        leases.top_up(p.r, ROLLOUT_QUEUE, cfg.run)
        p.wait_groups(1, timeout=90)
        (traj,) = p.trajectories()
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
    (session,) = by_label(server_url)["resume"]
    assert len(before) == 1 and before[0]["count"] < 10 + sum(adds)  # killed mid-episode
    assert traj.attempt == 2 and traj.resumed_from_turn >= 1
    assert session["seeds"] == 1
    assert session["calls"] == [f"increment_counter:{n}" for n in adds]
    assert session["count"] == 10 + sum(adds) and session["verifies"] == 1
    assert [s.reward for s in scores] == [1.0]
