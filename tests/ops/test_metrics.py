"""`streamrl metrics`: a real exporter process scraped over HTTP after a real run (rq workers,
the verifier, the learner), its figures checked against `streamrl status --json`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamrl import schema
from streamrl.config import RunConfig
from streamrl.envs import make_env
from streamrl.learner.config import LearnerConfig
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.ops.metric_feeds import DEAD_LETTER_CLASSES, dead_letter_class
from streamrl.producer.produce import Producer
from tests.support.cli import ROOT, run_cli

RUN = "met"
MEMORY_TOLERANCE = 2**20  # bytes: INFO used_memory moves with client buffers between reads


def scrape(url: str) -> dict[str, list]:
    """name of each sample -> [(labels, value)], from the text exposition."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    out["__text__"] = [text]
    return out


def one(samples: dict, name: str, **labels: str) -> float:
    hits = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    assert len(hits) == 1, f"{samples.get(name)} has not one {name}{labels}"
    return hits[0]


def start_exporter(env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "metrics", "--port", "0", "--addr", "127.0.0.1"],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stderr.readline()  # type: ignore[union-attr]
    m = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", line)
    assert m, f"exporter did not start: {line!r}"
    return proc, m.group(1)


@pytest.fixture
def learner_groups(tmp_path):
    """A tiny model and copy groups with real tokens, so the learner takes real steps."""
    from streamrl.models.tiny import save_tiny
    from tests.learner.groupdata import make_groups

    model = save_tiny(tmp_path / "tiny")
    return model, make_groups(model, 4, seed=2)


def test_scrape_of_a_run_matches_status(redis_url, subprocess_env, tmp_path, learner_groups):
    from streamrl.learner.loop import run_learner
    from tests.learner.groupdata import feed

    model, groups = learner_groups
    cfg = RunConfig(run=RUN, env="counter", group_size=4)
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"prompt": "count to 2"}\nnot json\n')
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        Producer(p.r, RUN).from_env(make_env("counter"), 12, 4, seed=1)
        Producer(p.r, RUN).from_jsonl(bad, "counter", 4)  # one row dead-lettered
        p.wait_groups(13)
        solved = msgspec.structs.replace(
            groups[0],
            samples=[
                msgspec.structs.replace(x, score=msgspec.structs.replace(x.score, reward=1.0))
                for x in groups[0].samples
            ],
        )  # every sample at the copy task's max_reward: a solved group
        feed(p.r, p.keys, [*groups, solved])  # after the scripted groups (no tokens: dropped)
        lcfg = LearnerConfig(
            model=str(model), output_dir=str(tmp_path / "out"), torch_threads=1,
            batch_groups=2, checkpoint_every=1, block_ms=100, lr=1e-3,
        )  # fmt: skip
        t = threading.Thread(
            target=run_learner, args=(redis_url, RUN, lcfg), kwargs={"exit_when_idle": 0.5}
        )
        t.start()
        t.join(120)
        assert not t.is_alive()

        env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": RUN}
        proc, url = start_exporter(env)
        try:
            before = p.r.info("memory")
            m = scrape(url)
            after = p.r.info("memory")
            run_keys = list(p.r.scan_iter(p.keys.key("*")))
            run_bytes = sum(p.r.memory_usage(k) or 0 for k in run_keys)
            status = json.loads(run_cli(["status", "--json"], env).stdout)
            again = scrape(url)  # a second scrape folds nothing twice
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0  # SIGTERM: a clean stop
        rewards = [
            s.reward
            for _, f in xrange_all(p.r, p.keys.scored)
            if (s := schema.SCORE.decode(f[b"p"])).reward is not None
        ]

    # the workers' log lines carry the same keys as every role's
    logs = [
        json.loads(line)
        for f in (tmp_path / "logs").glob("*")
        for line in f.read_text().splitlines()
        if line.startswith("{")
    ]
    dead_lines = [x for x in logs if x["event"] == "dead-lettered trajectory"]
    assert len(dead_lines) == 4
    assert all(x["run"] == RUN and x["role"] == "verify" and x["worker"] for x in dead_lines)
    assert len({x["task_id"] for x in dead_lines}) == 4  # the failed prompt's four samples

    assert one(m, "streamrl_redis_up") == 1
    for stage, info in status["stages"].items():
        assert one(m, "streamrl_stream_length", run=RUN, stream=stage) == info["length"]
        for group, g in info["groups"].items():
            lab = {"run": RUN, "stream": stage, "group": group}
            assert one(m, "streamrl_consumer_group_lag", **lab) == g["lag"]
            assert one(m, "streamrl_consumer_group_pending", **lab) == g["pending"]
    assert one(m, "streamrl_trajectories_total", run=RUN) == status["trajectories"] == 52
    # 12 generated prompts complete; the JSONL prompt has no `data` for the counter verifier,
    # so its 4 episodes fail: dead letters at the verifier, and its group is dropped
    assert one(m, "streamrl_groups_completed_total", run=RUN) == status["groups_completed"] == 12
    assert one(m, "streamrl_groups_dropped_total", run=RUN, reason="failed_sample") == 1
    assert one(m, "streamrl_policy_version", run=RUN) == status["policy_version"]
    ln = status["learner"]
    assert one(m, "streamrl_learner_step", run=RUN) == ln["step"] == 2
    assert one(m, "streamrl_learner_policy_version", run=RUN) == ln["policy_version"]
    assert one(m, "streamrl_learner_tokens_trained_total", run=RUN) == ln["tokens_trained"] > 0
    assert one(m, "streamrl_learner_status", run=RUN, status="stopped") == 1
    applied = sum(v for _, v in m["streamrl_learner_groups_applied_total"])
    assert applied == ln["groups_applied"] == 4
    by_staleness = json.loads(ln["applied_staleness"])
    for behind, n in by_staleness.items():
        assert one(m, "streamrl_learner_groups_applied_total", run=RUN, staleness=behind) == n
    for reason in ("stale", "zero_variance", "no_tokens", "invalid"):
        got = one(m, "streamrl_groups_dropped_total", run=RUN, reason=reason)
        assert got == ln[f"dropped_{reason}"]
    assert one(m, "streamrl_groups_dropped_total", run=RUN, reason="no_tokens") == 12
    # zero-variance groups told apart: solved or no signal, and their rates over the window
    assert one(m, "streamrl_learner_groups_solved_total", run=RUN) == ln["groups_solved"] == 1
    assert one(m, "streamrl_learner_groups_no_signal_total", run=RUN) == ln["groups_no_signal"]
    assert one(m, "streamrl_learner_solved_rate", run=RUN) == ln["solved_rate"] == 0.2
    assert one(m, "streamrl_learner_no_signal_rate", run=RUN) == ln["no_signal_rate"]
    assert one(m, "streamrl_learner_no_signal", run=RUN) == 0
    assert 0 <= one(m, "streamrl_learner_last_checkpoint_age_seconds", run=RUN) < 300
    # dead letters by stage and reason class
    dead = m["streamrl_dead_letters_total"]
    assert sum(v for _, v in dead) == status["dead_letters"] == 5
    assert one(m, "streamrl_dead_letters_total", run=RUN, stage="produce", reason="bad_row") == 1
    assert (
        one(m, "streamrl_dead_letters_total", run=RUN, stage="verify", reason="rollout_failed") == 4
    )
    # the reward histogram of the scored feed, labelled by environment; failures apart
    assert one(m, "streamrl_reward_count", run=RUN, env="counter") == len(rewards) == 48
    assert one(m, "streamrl_score_failures_total", run=RUN, env="counter") == 4
    assert len(rewards) + 4 == status["scored"]
    assert one(m, "streamrl_reward_sum", run=RUN, env="counter") == pytest.approx(sum(rewards))
    below = sum(1 for x in rewards if x <= 0.9)
    assert one(m, "streamrl_reward_bucket", run=RUN, env="counter", le="0.9") == below
    assert 0 < below < len(rewards)  # the scripted policy answers some samples wrong
    assert one(m, "streamrl_reward_count", run=RUN, env="counter") == one(
        again, "streamrl_reward_count", run=RUN, env="counter"
    )
    for queue, w in status["rq"].items():
        assert one(m, "streamrl_rq_workers", queue=queue) == w["workers"] == 1
        assert one(m, "streamrl_rq_failed_leases", queue=queue) == w["failed_leases"]
    # INFO used_memory as the exporter read it during the scrape: between the test's own
    # readings just before and after, give or take 1 MiB (client buffers come and go), and
    # more than the run's own keys take (MEMORY USAGE of each), which live in that memory
    used = one(m, "streamrl_redis_memory_used_bytes")
    lo, hi = sorted((before["used_memory"], after["used_memory"]))
    assert lo - MEMORY_TOLERANCE <= used <= hi + MEMORY_TOLERANCE, (used, lo, hi)
    assert used > run_bytes > 0
    assert one(m, "streamrl_redis_memory_max_bytes") == before["maxmemory"] == after["maxmemory"]
    # Prometheus conventions: counters end in _total, names are snake_case under streamrl_
    allowed = {"run", "stream", "group", "stage", "reason", "env", "queue", "staleness"}
    allowed |= {"status", "le"}
    text = m["__text__"][0]
    for family in text_string_to_metric_families(text):
        assert re.fullmatch(r"streamrl_[a-z_]+", family.name), family.name
        for s in family.samples:
            assert set(s.labels) <= allowed, (s.name, s.labels)
    assert re.findall(r"^# TYPE (\S+) counter$", text, re.M)
    for name in re.findall(r"^# TYPE (\S+) counter$", text, re.M):
        assert name.endswith("_total"), name


def test_exporter_reports_redis_down(tmp_path, subprocess_env):
    """No Redis behind it: the exporter still answers, with streamrl_redis_up 0."""
    from streamrl.local.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    env = {**subprocess_env, "STREAMRL_REDIS_URL": server.url, "STREAMRL_RUN": RUN}
    proc, url = start_exporter(env)
    try:
        assert one(scrape(url), "streamrl_redis_up") == 1
        server.stop()
        assert one(scrape(url), "streamrl_redis_up") == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        (
            "delivered 6 times (max 5): its workers died or its policy kept failing",
            "max_deliveries",
        ),
        ("undecodable trajectory: truncated", "undecodable"),
        ("rollout failed: environment error: KeyError: 'x'", "rollout_failed"),
        ("verifier copy raised ZeroDivisionError: x (after 3 attempts)", "verifier_error"),
        ("rows.jsonl:2: not JSON", "bad_row"),
        ("verifier did not finish within 10 s (after 3 attempts)", "verifier_timeout"),
        ("something new", "other"),
    ],
)
def test_dead_letter_reasons_map_to_a_bounded_set(reason, label):
    assert dead_letter_class(reason) == label
    assert label in DEAD_LETTER_CLASSES


def test_exporter_port_in_use_is_a_clear_error(redis_url, subprocess_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url}
        out = run_cli(["metrics", "--addr", "127.0.0.1", "--port", str(port)], env, timeout=60)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
