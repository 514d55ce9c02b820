"""The judge verifier through real rq verifier workers, against a real judge process
(``tests/support/judge_server.py``: a tiny transformers model sampling its answers behind
``POST /v1/chat/completions``), combined by weight with a TRL-style exact-answer check.

- Every sample is scored, its Score holding the judge's prompt, raw answer and parsed score,
  and the reward is the weighted sum of what the judge's own answer says and the check.
- Three verifier worker processes share one pool of 2: the server never sees more than 2
  calls at once (it counts them itself).
- Re-verifying the stored trajectories (``streamrl reverify``'s drift report) makes no call.
- A refusal (404) fails at once; a 503 is retried.
- A judge that hangs: its calls time out, are given up (the server sees its clients go), and
  the sample is a verifier failure; nothing is cached.
- A 429 or 503 with Retry-After holds every worker's calls off the endpoint that long (capped).
- The README's judge example, its config as written but for the endpoint.
- A judge answering 429 to everything, answering without a grade, and SIGKILLed mid-run and
  kept down, each past every retry: those samples are dead-lettered with the judge's reason and
  their groups dropped, none is a 0 made of a failure; the restarted server grades the rest.
- The collapse, disagree and canary tripwires, each from real samples of real workers.
- SmolLM2-135M-Instruct behind the suite's vLLM server as the judge (when vLLM installs).
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.cli import main
from streamrl.config import (
    EnvEntry,
    JudgeConfig,
    PolicyConfig,
    RunConfig,
    StreamConfig,
    TripwireConfig,
    VerifyConfig,
)
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.ops.drift import drift_report
from streamrl.ops.metrics import _Collector
from streamrl.ops.status import collect
from streamrl.producer import mixture
from streamrl.producer.datasets import open_rows
from streamrl.producer.mixture import CANARY, MixedProducer
from streamrl.producer.produce import Producer
from streamrl.producer.tripwires import Tripwires
from streamrl.schema import Message, Task, Trajectory
from streamrl.verifiers.judge import JudgeUnavailable, judge_stats
from streamrl.verifiers.reward_functions import RewardFunctions
from streamrl.workers.context import read_config
from streamrl.workers.verify import VerifyFailure, verify_one
from tests.support.judge_server import SERVED, save_judge_model
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2
WORKERS = 3
CHECK = "examples.trl_rewards:exact_answer"
RUBRIC = "Question: {prompt} Expected: {ground_truth} Answer: {response} Score:"
SHORTCUT = "tests.support.envs:ShortcutCounter"
COUNTER_CHECK = "tests.support.trl_rewards:counter_answer"


class JudgeProcess:
    """The judge server as a process this test owns: started, SIGKILLed, started again on
    the same port (the run's config names it)."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log = model_dir, log
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.incarnations: list[dict[str, Any]] = []  # the last stats of each killed process

    def start(self, delay_s: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.judge_server", str(self.model_dir),
             str(self.port), str(delay_s)],
            cwd=ROOT, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )  # fmt: skip
        wait_for(lambda: self.stats() is not None, "the judge server to listen", 60, every=0.1)

    def stats(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url + "/stats", timeout=5) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def admin(self, **knobs: Any) -> None:
        req = urllib.request.Request(self.url + "/admin", data=json.dumps(knobs).encode())
        urllib.request.urlopen(req, timeout=5).close()

    def kill(self) -> None:
        assert self.proc is not None
        self.incarnations.append(self.stats() or {})
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    d = tmp_path_factory.mktemp("judge")
    server = JudgeProcess(save_judge_model(d / "model"), d / "server.log")
    server.start(delay_s=0.15)  # each call stays in flight a while: the pool has to hold
    yield server
    server.stop()


def _config(run: str, url: str, **judge: Any) -> RunConfig:
    return RunConfig(
        run=run,
        env="chat",
        env_options={"reference": "{ground_truth}"},
        group_size=2,
        policy=PolicyConfig(wrong_rate=0.25),
        verifier=["judge", CHECK],
        reward_weights=[0.5, 0.5],
        judge=JudgeConfig(
            base_url=url + "/v1",
            model=SERVED,
            prompt=RUBRIC,
            score_pattern=r"(\d)",
            max_score=9,
            temperature=1.0,
            **{"max_tokens": 4, "max_in_flight": LIMIT, **judge},
        ),
        verify=VerifyConfig(timeout_s=60, retries=2, batch=4),
        streams=StreamConfig(claim_idle_ms=3000, heartbeat_s=0.5),
    )


def _rows(path: Path, n: int, start: int = 0) -> Path:
    rows = [
        {"prompt": f"What is {i} + {i}?", "ground_truth": str(2 * i)}
        for i in range(start, start + n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(p: LocalPipeline, rows: Path, prompts: int) -> None:
    res = Producer(p.r, p.config.run).from_rows(open_rows(rows), "chat", 2, standard_prompts=True)
    assert res.prompts == prompts and not res.rejected


def _scores(p: LocalPipeline) -> list[schema.Score]:
    return [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]


def _dead(p: LocalPipeline) -> list[schema.DeadLetter]:
    return [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.dead)]


def _check_scored(s: schema.Score, answers: dict[str, str]) -> None:
    """The reward is made of the judge's own answer and the exact check, nothing else."""
    j = s.info["judge"]
    first = re.search(r"\d", j["raw"])
    assert first is not None and j["score"] == float(first.group())
    assert j["prompt"].startswith("Question: What is") and "Score:" in j["prompt"]
    assert s.info["reward_functions"]["judge"] == pytest.approx(j["score"] / 9)
    exact = s.info["reward_functions"]["exact_answer"]
    expected = re.search(r"Expected: (\S+) Answer:", j["prompt"]).group(1)
    assert exact == (1.0 if answers[s.task_id].strip() == expected else 0.0)
    assert s.reward == pytest.approx(0.5 * j["score"] / 9 + 0.5 * exact)


def _tasks_of(p: LocalPipeline) -> list[tuple[bytes, Task]]:
    return [(eid, schema.TASK.decode(f[b"p"])) for eid, f in xrange_all(p.r, p.keys.tasks)]


def _dead_ids(p: LocalPipeline) -> set[str]:
    return {d.task_id for d in _dead(p)}


def _rewarded(p: LocalPipeline) -> set[str]:
    return {s.task_id for s in _scores(p) if s.reward is not None}


def _answers(p: LocalPipeline) -> dict[str, str]:
    out = {}
    for _, f in xrange_all(p.r, p.keys.rollouts):
        t = schema.TRAJECTORY.decode(f[b"p"])
        out[t.task_id] = t.items[-1].content
    return out


def test_judge_scores_every_sample_within_the_pool_and_pays_once(
    judge, redis_url, subprocess_env, tmp_path
):
    prompts = 8
    judge.admin(reset_max=True)
    before = judge.stats()["calls"]
    cfg = _config("judge-ok", judge.url)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        _run(p, _rows(tmp_path / "rows.jsonl", prompts), prompts)
        p.start_workers(rollout=1, verify=WORKERS)
        p.wait_groups(prompts, timeout=120)
        scores, dead, answers = _scores(p), _dead(p), _answers(p)
        judged = judge_stats(p.r, cfg.run)
        shown = collect(p.r, cfg.run)["judge"]  # streamrl status
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(p.r, lambda: [cfg.run]))  # streamrl metrics
        scraped = {
            s.name: s.value
            for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples
            if s.name.startswith("streamrl_judge_")
        }
        calls = judge.stats()["calls"] - before
        again = drift_report(p.r, cfg.run)  # re-verify every stored trajectory
        after = judge.stats()
        rejudged = judge_stats(p.r, cfg.run)
    assert not dead and len(scores) == 2 * prompts
    for s in scores:
        assert s.reward is not None, s.failure
        _check_scored(s, answers)
    # every call the workers made reached the server; a sample whose judge input had been
    # answered (the same answer to the same question) was not sent again, an unparseable
    # answer was asked again
    distinct = len({s.info["judge"]["prompt"] for s in scores})
    assert judged["samples"] == 2 * prompts and judged["calls"] == calls and shown == judged
    assert scraped["streamrl_judge_calls_total"] == calls
    assert scraped["streamrl_judge_samples_total"] == 2 * prompts
    assert scraped["streamrl_judge_cache_hits_total"] == judged.get("cached", 0)
    assert judged.get("cached", 0) == 2 * prompts - distinct and calls >= distinct
    assert after["max_in_flight"] <= LIMIT  # 3 workers, one pool of 2
    # the cache: re-verifying 16 samples made no call and changed no reward
    (row,) = again["drift"]
    assert row["samples"] == 2 * prompts and row["changed"] == row["failed"] == 0
    assert after["calls"] - before == calls
    assert rejudged["cached"] - judged.get("cached", 0) == 2 * prompts
    assert rejudged["calls"] == calls
    print(
        f"\njudge figures: run {judged}, reverify {rejudged}; distinct judge inputs "
        f"{distinct}; server calls {calls} then {after['calls'] - before}; "
        f"server max in flight {after['max_in_flight']}"
    )


def _sample(i: int) -> tuple[Task, Trajectory]:
    task = Task(task_id=f"p{i}:0", prompt_id=f"p{i}", k=0, group_size=1, env="chat",
                input=[Message(role="user", content=f"What is {i} + {i}?")],
                data={"ground_truth": str(2 * i)})  # fmt: skip
    traj = Trajectory(task_id=task.task_id, prompt_id=task.prompt_id, k=0, group_size=1,
                      env="chat", items=[*task.input, Message(role="assistant", content="2")],
                      n_input=1, turns=[], status="completed", data=task.data)  # fmt: skip
    return task, traj


def test_a_hanging_judge_is_a_failure_and_its_calls_are_given_up(judge, r):
    cfg = _config("judge-hang", judge.url, timeout_s=0.5, retries=1, backoff_s=0.05)
    rewards = RewardFunctions.of_run(cfg, r)
    _, traj = _sample(1)
    judge.admin(hang=True)
    try:
        with pytest.raises(VerifyFailure, match=r"judge timed out .* \(after 2 attempts\)"):
            verify_one(make_env("chat"), traj, timeout_s=30, retries=0, rewards=rewards)
        # each attempt held a slot only while its request was out; the server saw both go
        wait_for(lambda: judge.stats()["in_flight"] == 0, "the server to drop the calls", 10)
    finally:
        judge.admin(hang=False)
    assert judge_stats(r, cfg.run) == {"calls": 2, "failures": 1}
    assert not r.keys("*judge:cache*")  # nothing to remember
    assert all(not r.zcard(k) for k in r.keys("*judge:pool*busy"))  # no slot left held


def test_a_refusal_is_a_failure_at_once_and_a_5xx_is_retried(judge, r):
    cfg = _config("judge-refused", judge.url, retries=8, backoff_s=0.01, max_tokens=8)
    rewards = RewardFunctions.of_run(cfg, r)
    task, traj = _sample(2)
    judge.admin(fail_next=1, status=404)  # a wrong model name, say: asking again cannot help
    with pytest.raises(JudgeUnavailable, match="HTTP 404 \\(not retried\\)"):
        rewards.judge.score(task, traj)
    assert judge_stats(r, cfg.run) == {"calls": 1, "failures": 1}
    judge.admin(fail_next=2, status=503)
    _, info = rewards.judge.score(task, traj)
    assert info["calls"] >= 3 and not info["cached"]


def test_retry_after_holds_the_whole_run_off_the_endpoint(judge, r):
    """A 429 with ``Retry-After: 1``: neither the told call's retry nor another worker's
    call (a second judge on the run: another process's pool) reaches the server sooner than
    1 s after it, though ``backoff_s`` alone would retry after 0.01 s. A 503 asking for an
    hour is obeyed for ``retry_after_max_s`` (1 s) only."""
    cfg = _config("judge-retry-after", judge.url, retries=2, backoff_s=0.01,
                  backoff_max_s=0.01, retry_after_max_s=1)  # fmt: skip
    told, other = (RewardFunctions.of_run(cfg, r).judge for _ in range(2))
    pool = told._pool
    judge.admin(reply="Score: 7")  # a grade on every answer: only the 429 is retried
    try:
        for status, asked, held in ((429, 1, 1.0), (503, 3600, 1.0)):
            start = len(judge.stats()["log"])
            judge.admin(fail_next=1, status=status, retry_after=asked)
            first = ThreadPoolExecutor(1)
            told_done = first.submit(told.score, *_sample(10 + status))
            wait_for(pool.held_for, "the pool to be held off the endpoint", 30, every=0.005)
            _, info = other.score(*_sample(20 + status))  # starts while held
            assert told_done.result(timeout=30)[1]["calls"] == 2 and info["calls"] == 1
            first.shutdown()
            log = judge.stats()["log"][start:]
            (at, _), later = log[0], log[1:]
            assert log[0][1] == status and [s for _, s in later] == [200, 200]
            assert all(t - at >= held for t, _ in later), (status, log)
            gaps = [round(t - at, 3) for t, _ in later]
            print(f"\nHTTP {status}, Retry-After {asked}: the next calls came {gaps} s after")
    finally:
        judge.admin(reply=None)
    assert judge_stats(r, cfg.run) == {"calls": 6, "samples": 4, "throttled": 2}


def test_one_worker_keeps_several_calls_out_and_scores_from_them(judge, r):
    """``Judge.prefetch`` (what a verifier worker does with each batch): six samples asked for
    side by side under a pool of 3, then scored in order without another call."""
    # scored here without the worker's retries: room for the tiny model's answers with no digit
    cfg = _config("judge-prefetch", judge.url, max_in_flight=3, retries=6, max_tokens=8)
    rewards = RewardFunctions.of_run(cfg, r)
    samples = [_sample(i) for i in range(6)]
    judge.admin(reset_max=True)
    beats = []
    rewards.judge.prefetch(samples, lambda: beats.append(1), every_s=0.05)
    sent = judge_stats(r, cfg.run)["calls"]
    most = judge.stats()["max_in_flight"]
    assert 2 <= most <= 3 and beats
    for task, traj in samples:
        _, info = rewards.judge.score(task, traj)
        assert info["score"] == float(re.search(r"\d", info["raw"]).group())
    assert judge_stats(r, cfg.run) == {"calls": sent, "samples": 6}
    print(f"\nprefetch: 6 samples, {sent} calls, server max in flight {most} (pool of 3)")


def test_the_readme_judge_example(judge, r, redis_url, tmp_path, monkeypatch):
    """The README's config and commands as written, but for the endpoint: this suite's judge
    server, its model, and temperature 1 (a tiny random model names a grade only when it
    samples). The producer's tasks are then graded in this process."""
    section = (ROOT / "README.md").read_text().split("## LLM judges", 1)[1].split("\n## ", 1)[0]
    config = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    endpoint = 'base_url = "http://127.0.0.1:8001/v1"'
    assert endpoint in config and '\nmodel = "judge"\n' in config
    config = config.replace(endpoint, f'base_url = "{judge.url}/v1"').replace(
        '\nmodel = "judge"\n', f'\nmodel = "{SERVED}"\ntemperature = 1.0\n'
    )
    (tmp_path / "judge.toml").write_text(config)
    produce = re.search(r"```bash\n(streamrl produce .*?)\n(?!\s)", section, re.S).group(1)
    argv = shlex.split(produce.replace("\\\n", " "))[1:]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = CliRunner().invoke(
        main, argv, env={"STREAMRL_REDIS_URL": redis_url}, catch_exceptions=False
    )
    assert done.exit_code == 0, done.output
    cfg = read_config(r.get(Keys("judge-add").config))
    assert cfg.verifier == ["judge", "examples.trl_rewards:no_extra_words"]
    rewards = RewardFunctions.of_run(cfg, r)
    tasks = [schema.TASK.decode(f[b"p"]) for _, f in xrange_all(r, Keys(cfg.run).tasks)]
    assert len(tasks) == 64 * 4
    for task in tasks[:8:4]:  # two prompts, answered right (the scripted policy's reference)
        answer = Message(role="assistant", content=task.data["ground_truth"])
        traj = Trajectory(task_id=task.task_id, prompt_id=task.prompt_id, k=task.k,
                          group_size=task.group_size, env=task.env, items=[*task.input, answer],
                          n_input=len(task.input), turns=[], status="completed",
                          data=task.data)  # fmt: skip
        verdict = rewards.score(task, traj)
        j = verdict.info["judge"]
        assert f"Reference answer: {task.data['ground_truth']}" in j["prompt"]
        assert j["score"] == float(re.search(r"\d+", j["raw"]).group())
        assert verdict.reward == pytest.approx(0.8 * j["score"] / 10 + 0.2 * 1.0)


def test_a_judge_failing_past_its_retries_is_a_dead_letter_never_a_reward(
    judge, redis_url, subprocess_env, tmp_path
):
    """Each way a judge fails, past every retry (the judge's 2, then the worker's 1): a 429 on
    every call, answers with no grade in them, and the server SIGKILLed mid-run (after 2
    grades, with calls hanging in it) and kept down until a sample has run out of retries.
    Every sample the judge did not grade is dead-lettered with the judge's reason and its group
    dropped, never scored 0; every other sample is scored from the grade the judge gave it (the
    restarted server's too); the server never saw more calls at once than the pool's 2, in
    either of its processes."""
    cfg = _config("judge-chaos", judge.url, retries=2, backoff_s=0.05, backoff_max_s=0.2)
    cfg = msgspec.structs.replace(cfg, verify=VerifyConfig(timeout_s=60, retries=1, batch=4))
    judge.admin(reset_max=True)
    judge.incarnations.clear()
    phases: dict[str, set[str]] = {}  # phase -> the task ids it pushed

    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:

        def push(phase: str, prompts: int, dead: int) -> None:
            """Push the phase's prompts (questions of its own: no answer from the cache); wait
            until ``dead`` samples of it are dead letters."""
            rows = _rows(tmp_path / f"{phase}.jsonl", prompts, start=10 * len(phases))
            _run(p, rows, prompts)
            tasks = {t.task_id for _, t in _tasks_of(p) if t.prompt_id.startswith(f"{phase}-")}
            phases[phase] = tasks
            wait_for(lambda: len({d for d in _dead_ids(p) if d in tasks}) >= dead,
                     f"{dead} dead letters of {phase}", 60)  # fmt: skip

        p.start_workers(rollout=1, verify=WORKERS)
        judge.admin(fail_all=429, retry_after=0.05, delay_s=0)  # overloaded, for good
        push("throttled", 1, dead=2)
        judge.admin(fail_all=None, reply="no grade here")  # answers, never a grade
        push("ungraded", 1, dead=2)
        judge.admin(reply=None, hang_after=2)  # 2 grades, then every call hangs
        base = judge.stats()["statuses"].get("200", 0)
        push("killed", 4, dead=0)  # 4 questions: at least 4 calls

        def hung() -> bool:
            st = judge.stats()
            return st["statuses"].get("200", 0) - base == 2 and st["in_flight"] > 0

        wait_for(hung, "2 grades and a call hanging", 60)
        judge.kill()  # mid-run: calls in flight die with it, and it stays down a while
        wait_for(lambda: _dead_ids(p) & phases["killed"], "a sample given up while down", 60)
        judge.start(delay_s=0.15)
        push("recovered", 1, dead=0)  # graded by the restarted server
        p.wait_groups(7, timeout=120)
        samples = {t for tasks in phases.values() for t in tasks}
        wait_for(lambda: len(_dead_ids(p)) + len(_rewarded(p)) == len(samples), "every sample")
        scores, dead, answers = _scores(p), _dead(p), _answers(p)
        groups = {schema.GROUP.decode(f[b"p"]).prompt_id for _, f in xrange_all(p.r, p.keys.groups)}
        dropped = p.stat("groups_dropped")
        judged = judge_stats(p.r, cfg.run)
    judge.incarnations.append(judge.stats())
    reasons = {d.task_id: d.reason for d in dead}
    assert all(d.stage == "verify" for d in dead)
    assert all("judge answered HTTP 429" in reasons[t] for t in phases["throttled"])
    assert all("judge answer holds no score" in reasons[t] for t in phases["ungraded"])
    downed = [reasons[t] for t in phases["killed"] if t in reasons]
    assert downed and all("judge connection error" in why for why in downed), downed
    # a dead sample has no reward anywhere, its group was dropped; the rest were graded
    for s in scores:
        if s.task_id in reasons:
            assert s.reward is None and "judge" in s.failure
        else:
            _check_scored(s, answers)
    dead_prompts = {t.rsplit(":", 1)[0] for t in reasons}
    assert dropped == len(dead_prompts) and not groups & dead_prompts
    assert len(groups) == 7 - dropped and all(t not in reasons for t in phases["recovered"])
    assert max(st["max_in_flight"] for st in judge.incarnations) <= LIMIT
    assert judge.incarnations[-1]["calls"] > 0
    print(
        f"\ndead-lettered {len(reasons)} of {len(samples)} samples (429: "
        f"{len(phases['throttled'])}, no grade: {len(phases['ungraded'])}, server down: "
        f"{len(downed)}), groups dropped {dropped}, kept {len(groups)}; judge figures {judged}; "
        f"max in flight per server process {[st['max_in_flight'] for st in judge.incarnations]}, "
        f"calls per server process {[st['calls'] for st in judge.incarnations]}, in flight "
        f"at the kill {judge.incarnations[0]['in_flight']}"
    )


def test_each_tripwire_fires_from_real_judged_samples_and_pauses_its_env(
    judge, redis_url, subprocess_env, run_name, tmp_path
):
    """Three environments of one mixture, each built to trip one wire, through real rollout
    and verifier workers and the real judge process; the producer's ``Tripwires`` (what
    ``streamrl produce`` runs before every batch) read the groups the verifiers assembled:

    - ``shortcut`` (``ShortcutCounter``): from prompt 24 on the prompt leaks the answer and
      the agent stops using the tool: reward rises from 0.5 to 1 while tool calls fall to 0;
    - ``judged`` (the judge weighted with a programmatic check, ``counter_answer``): the
      judge grades 9 of 9 as the check does, then 0 while the check still says right;
    - ``canary`` (the judge alone, half its prompts canaries): the same canary answers graded
      9, then 0 by a judge swapped behind the same URL and version (canaries skip the cache).

    Nothing fires on the first 24 prompts; on the next 24 each wire fires on its own
    environment and pauses it, with its one-line reason in ``streamrl status``."""
    wires = TripwireConfig(window=4, pause=True)
    cfg = RunConfig(
        run=run_name,
        group_size=2,
        policy=PolicyConfig(wrong_rate=0.0),
        envs=[
            EnvEntry(name="shortcut", env=SHORTCUT, env_options={"leak_from": 24}, tripwires=wires),
            EnvEntry(
                name="judged",
                env="counter",
                env_options={"steps": 1},
                verifier=["judge", COUNTER_CHECK],
                reward_weights=[0.5, 0.5],
                tripwires=wires,
            ),
            EnvEntry(
                name="canary",
                env="counter",
                env_options={"steps": 0},
                verifier=["judge"],
                tripwires=TripwireConfig(window=4, pause=True, canary_every=2, canaries=2),
            ),
        ],
        judge=JudgeConfig(
            base_url=judge.url + "/v1",
            model=SERVED,
            score_pattern=r"(\d)",
            prompt="Task: {prompt} Answer: {response} Score:",
            max_score=9,
            max_in_flight=LIMIT,
            retries=2,
            backoff_s=0.05,
        ),
        verify=VerifyConfig(timeout_s=60, retries=1, batch=8),
    )
    judge.admin(reply="Score: 9", delay_s=0)
    try:
        with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
            mixture.ensure(p.r, run_name, cfg.mixture())
            producer = MixedProducer(Producer(p.r, run_name, batch_samples=16), run_name, 2)
            tripwires = Tripwires(p.r, run_name)
            p.start_workers(rollout=1, verify=2)
            producer.run_until(24)
            p.wait_groups(24, timeout=120)
            quiet = tripwires.check()
            judge.admin(reply="Score: 0")  # the judge changes its mind, same URL and version
            producer.run_until(48)
            p.wait_groups(48, timeout=120)
            fired = tripwires.check()
            held = mixture.paused(p.r, run_name)
            scores = _scores(p)
            figures = judge_stats(p.r, run_name)
            shown = CliRunner().invoke(main, ["--redis", redis_url, "--run", run_name, "status"])
    finally:
        judge.admin(reply=None, delay_s=0.15)
    assert quiet == {} and all(n >= 8 for n in producer.drawn.values()), producer.drawn
    assert fired["shortcut"].startswith(
        "tripwire collapse: reward rose +0.50 while tool calls fell from 2.0 to 0.0"
    ), fired
    assert fired["judged"].startswith(
        "tripwire disagree: the judge and counter_answer disagree (by more than 0.5) on 4 of "
        "the latest 4 samples (judge mean 0.00, counter_answer mean 1.00)"
    ), fired
    assert fired["canary"].startswith(
        "tripwire canary: canary prompts' reward moved -1.00 from 1.00"
    ), fired
    assert held == fired  # each paused with its reason
    text = " ".join(shown.output.split())
    calls = f"judge calls {figures['calls']} for {figures['samples']} samples"
    judged = [s for s in scores if "judge" in s.components]  # shortcut's are not
    assert calls in text and figures["samples"] == len(judged), shown.output
    for name, line in fired.items():
        assert f"PAUSED {name}: {line[:40]}" in text, shown.output
    # every canary sample was judged afresh, the same answer to the same canary included
    canaries = [s for s in scores if s.prompt_id.startswith(CANARY)]
    assert 0 < len(canaries) < 2 * producer.drawn["canary"]  # about one prompt in 2
    assert not any(s.info["judge"]["cached"] for s in canaries)
    asked = [s.info["judge"]["prompt"] for s in canaries]
    assert len(set(asked)) < len(asked)
    print(f"\nprompts drawn {producer.drawn}; canary samples {len(canaries)}; fired:")
    print("\n".join(f"{name}: {line}" for name, line in fired.items()))


def test_a_real_instruct_model_judges_through_vllm(vllm, r):
    """SmolLM2-135M-Instruct behind the suite's vLLM server (the ``vllm`` fixture; skipped
    where vLLM cannot install) as the judge, through the run's pool and cache: each sample is
    graded with the digit the model's own reply holds, or is a failure saying why; the second
    sample of each judge input is answered from the cache, with the first one's grade."""
    rubric = (
        "Question: {prompt}\nAnswer: {response}\nGrade the answer from 0 (wrong) to 9 (right). "
        "Reply with one digit only."
    )
    judge_cfg = JudgeConfig(base_url=vllm.url + "/v1", model=vllm.served_name, prompt=rubric,
                            score_pattern=r"(\d)", max_score=9, max_tokens=8, temperature=0.0,
                            retries=1, backoff_s=0.05, max_in_flight=2)  # fmt: skip
    cfg = RunConfig(run="judge-vllm", env="chat", verifier=["judge"], judge=judge_cfg)
    grader = RewardFunctions.of_run(cfg, r).judge
    samples = [_sample(i) for i in range(4)] * 2  # 8 samples, 4 judge inputs
    grader.prefetch(samples, lambda: None, every_s=1.0)
    results: list[dict[str, Any] | str] = []
    for task, traj in samples:
        try:
            results.append(grader.score(task, traj)[1])
        except JudgeUnavailable as e:
            results.append(str(e))
    graded = [x for x in results if isinstance(x, dict)]
    failed = [x for x in results if isinstance(x, str)]
    assert graded and all("judge answer holds no score" in why for why in failed), failed
    for info in graded:
        assert info["score"] == float(re.search(r"\d", info["raw"]).group())
    for first, again in zip(results[:4], results[4:], strict=True):
        if isinstance(first, dict):
            assert isinstance(again, dict) and again["cached"] and again["calls"] == 0
            assert again["score"] == first["score"]
    figures = judge_stats(r, cfg.run)
    assert figures["samples"] == len(graded)
    assert figures.get("cached", 0) == sum(info["cached"] for info in graded)
    print(
        f"\nvLLM judge: {len(graded)} graded {[i['score'] for i in graded]}, {len(failed)} "
        f"failed; raw {[i['raw'] for i in graded[:4]]}; figures {figures}"
    )
