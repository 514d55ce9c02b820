"""Policy health end to end, with real rq rollout workers: a worker that cannot load the newest
policy shows it in ``streamrl status``, fails its lease with the reason once it has been too far
behind for too long, faults the run, and the learner stops with that one line. What it held
stays pending; nothing is scored because of it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from safetensors.torch import save_file

from streamrl.bus import health
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig
from streamrl.defaults import ROLLOUT_GROUP, ROLLOUT_QUEUE
from streamrl.envs import make_env
from streamrl.learner.config import LearnerConfig
from streamrl.learner.loop import run_learner
from streamrl.local.pipeline import LocalPipeline, task_ids, xrange_all
from streamrl.models.tiny import build_model, save_tiny
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer
from streamrl.schema import SCORE, TRAJECTORY, PolicyVersion, encode
from streamrl.workers import leases
from tests.support.waiting import wait_for

# Fast heartbeats, so the guard (checked on each heartbeat) trips soon after its time is up.
STREAMS = StreamConfig(heartbeat_s=0.2, claim_idle_ms=60_000)
PROMPTS, GROUP = 40, 2
WAIT_S = 90.0  # bounded waits: a healthy machine meets each condition in seconds


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def worker_env(subprocess_env):
    return {**subprocess_env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def announce(p: LocalPipeline, version: int, path: str) -> None:
    pv = PolicyVersion(version=version, step=version, path=path, format="safetensors")
    p.r.xadd(p.keys.policy, {"p": encode(pv)})


def failures(p: LocalPipeline, at_least: int) -> dict | None:
    """The rollout queue's failed leases, once there are ``at_least`` of them."""
    info = leases.failures(p.r, ROLLOUT_QUEUE)
    return info if info["failed_leases"] >= at_least else None


def group_info(p: LocalPipeline, stream: str, group: str) -> dict:
    return next(g for g in p.r.xinfo_groups(stream) if g["name"].decode() == group)


def hf_config(run: str, model_dir) -> RunConfig:
    """The hf backend on the tiny model; the guard trips 1 s after a worker falls more than
    1 version behind."""
    return RunConfig(
        run=run,
        env="copy",
        group_size=GROUP,
        policy=PolicyConfig(
            backend="hf",
            model=str(model_dir),
            max_new_tokens=4,
            options={"device": "cpu", "dtype": "float32", "reload_check_s": 0.2, "max_batch": 8},
        ),
        rollout=RolloutConfig(max_concurrent=4, read_batch=4, max_policy_lag_s=1.0),
        streams=STREAMS,
        learner={"max_staleness": 1},
    )


def corrupt_version(directory):
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    return directory


def test_a_worker_that_cannot_load_the_policy_faults_the_run(
    tiny_dir, redis_url, worker_env, tmp_path
):
    run = "stale-hf"
    cfg = hf_config(run, tiny_dir)
    corrupt = corrupt_version(tmp_path / "v2")
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=worker_env) as p:
        announce(p, 0, str(tiny_dir))
        announce(p, 2, str(corrupt))  # 2 versions ahead of what the workers can serve
        Producer(p.r, run).from_env(make_env("copy"), PROMPTS, GROUP, seed=0)
        p.start_workers(rollout=1, verify=1)
        worker = p.procs.procs[0][0]
        wait_for(lambda: health.fault(p.r, p.keys), "the run's fault", WAIT_S, every=0.1)
        wait_for(lambda: failures(p, at_least=1), "a failed rollout lease", WAIT_S, every=0.1)
        # what the verifier was handed before the fault is scored; then nothing moves
        wait_for(
            lambda: (
                group_info(p, p.keys.rollouts, "verify")["pending"] == 0
                and group_info(p, p.keys.rollouts, "verify")["lag"] == 0
            ),
            "the verifier to drain",
            WAIT_S,
            every=0.1,
        )
        p.stop()
        # read once the workers are gone: each failing lease writes the fault again, with a
        # longer time behind, so a copy taken while they ran may be out of date
        fault = health.fault(p.r, p.keys)
        failed = failures(p, at_least=1)
        shown = collect(p.r, run)["policy_health"]
        tasks = group_info(p, p.keys.tasks, ROLLOUT_GROUP)
        scores = [SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        trajectories = [TRAJECTORY.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.rollouts)]
        dead = p.r.xlen(p.keys.dead)

    # status: the version served, how far behind, and why
    assert shown["fault"] == fault
    record = shown["workers"][worker]
    assert (record["version"], record["newest"], record["lag"]) == (0, 2, 2)
    assert record["behind_s"] is not None
    assert record["error"].startswith("SafetensorError: ")

    # the lease failed with the reason as the last line of its rq job
    reason = f"worker {worker} serves policy version 0, 2 behind newest 2 (max_staleness 1) for "
    assert failed["last_failure"].startswith(f"streamrl.bus.health.PolicyStale: {reason}")
    assert "; last reload error: SafetensorError: " in failed["last_failure"]
    assert fault.startswith(f"PolicyStale: {reason}")
    assert "; last reload error: SafetensorError: " in fault
    assert "\n" not in fault

    # nothing was scored because of the fault: every score is a real verdict on a trajectory
    # the worker finished; whatever it did not finish is still in the tasks stream, unacked
    expected = task_ids("copy", 0, PROMPTS, GROUP)
    assert dead == 0
    assert all(s.reward is not None and s.failure is None for s in scores)
    assert all(t.status != "failed" for t in trajectories)
    per_task = Counter(s.task_id for s in scores)
    assert set(per_task) <= expected and set(per_task.values()) <= {1}
    assert set(per_task) == {t.task_id for t in trajectories}
    assert len(trajectories) + tasks["pending"] + tasks["lag"] == len(expected)

    # the learner stops with the reason, in one line
    learner_cfg = LearnerConfig(
        model=str(tiny_dir), output_dir=str(tmp_path / "learner"), device="cpu"
    )
    with pytest.raises(health.RunFaulted) as stopped:
        run_learner(redis_url, run, learner_cfg, exit_when_idle=5)
    assert str(stopped.value) == health.one_line(fault)
    config = tmp_path / "learn.toml"
    config.write_text(
        f'run = "{run}"\n[learner]\nmodel = "{tiny_dir}"\n'
        f'output_dir = "{tmp_path / "learner"}"\ndevice = "cpu"\n'
    )
    learn = ["learn", "--config", str(config), "--redis", redis_url, "--run", run]
    cli = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *learn],
        capture_output=True,
        text=True,
        env=worker_env,
        timeout=120,
    )
    assert cli.returncode == 1
    assert "Traceback" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == f"Error: {fault}"


def test_a_worker_that_loads_the_policy_again_clears_its_fault(
    tiny_dir, redis_url, worker_env, tmp_path
):
    """Self-healing: once the announced weights can be loaded (here: the file is repaired), a
    later lease of the same worker serves them and takes back the fault it raised."""
    run = "stale-heal"
    broken = corrupt_version(tmp_path / "v2")
    with LocalPipeline(
        hf_config(run, tiny_dir), url=redis_url, directory=tmp_path, worker_env=worker_env
    ) as p:
        announce(p, 0, str(tiny_dir))
        announce(p, 2, str(broken))
        p.start_workers(rollout=1, verify=0)
        worker = p.procs.procs[0][0]
        wait_for(lambda: health.fault(p.r, p.keys), "the run's fault", WAIT_S, every=0.1)
        fixed = build_model(seed=1)
        save_file(
            {k: v.contiguous() for k, v in fixed.state_dict().items()},
            broken / "model.safetensors",
        )

        def healed() -> dict | None:
            shown = collect(p.r, run)["policy_health"]
            served = shown["workers"].get(worker, {}).get("version")
            return shown if shown["fault"] is None and served == 2 else None

        shown = wait_for(
            healed, "the worker to serve version 2 and clear the fault", WAIT_S, every=0.1
        )
        p.stop()
    record = shown["workers"][worker]
    assert (record["lag"], record["behind_s"], record["error"]) == (0, None, None)


def test_a_stale_worker_leaves_what_it_holds_pending(redis_url, worker_env, tmp_path):
    """The scripted policy never changes version: with a newer one announced it is behind from
    the start. Its episodes hang (latency), so the worker holds tasks when the guard trips:
    they stay pending, unscored, and no later lease of the worker takes more."""
    run = "stale-held"
    cfg = RunConfig(
        run=run,
        env="copy",
        group_size=GROUP,
        policy=PolicyConfig(latency_s=3600),
        rollout=RolloutConfig(max_concurrent=4, read_batch=4, max_policy_lag_s=1.0),
        streams=STREAMS,
        learner={"max_staleness": 1},
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=worker_env) as p:
        announce(p, 5, str(tmp_path))
        Producer(p.r, run).from_env(make_env("copy"), 4, GROUP, seed=0)
        p.start_workers(rollout=1, verify=1)
        worker = p.procs.procs[0][0]
        fault = wait_for(lambda: health.fault(p.r, p.keys), "the run's fault", WAIT_S, every=0.1)
        # the lease that tripped, and its successor, which trips before it takes any task
        failed = wait_for(
            lambda: failures(p, at_least=2), "two failed rollout leases", WAIT_S, every=0.1
        )
        shown = collect(p.r, run)["policy_health"]["workers"][worker]
        pending = p.r.xpending_range(p.keys.tasks, ROLLOUT_GROUP, "-", "+", 100)
        tasks = group_info(p, p.keys.tasks, ROLLOUT_GROUP)
        streams = [p.r.xlen(k) for k in (p.keys.rollouts, p.keys.scored, p.keys.dead)]
        p.stop()

    reason = f"worker {worker} serves policy version 0, 5 behind newest 5 (max_staleness 1) for "
    assert fault.startswith(f"PolicyStale: {reason}")
    assert fault.endswith("; last reload error: none")
    assert failed["last_failure"].startswith(f"streamrl.bus.health.PolicyStale: {reason}")
    assert (shown["version"], shown["newest"], shown["error"]) == (0, 5, None)
    # the 4 tasks it read (read_batch) are still its pending entries, delivered once
    assert len(pending) == 4 and tasks["lag"] == 4
    assert {e["consumer"].decode() for e in pending} == {worker}
    assert {e["times_delivered"] for e in pending} == {1}
    assert streams == [0, 0, 0]


def test_a_tampered_version_is_refused_and_shown_in_status(
    tiny_dir, redis_url, worker_env, tmp_path
):
    """Policy integrity end to end: a real rq rollout worker loads the learner's honest v1,
    refuses v2 once a byte of its weights is changed on disk (no silent fall-back: it keeps
    serving v1 and says why), and ``streamrl status`` shows the refusal."""
    from streamrl.learner import publish
    from streamrl.models.tiny import build_tokenizer
    from streamrl.policy.integrity import digest_dir

    run = "tampered"
    cfg = hf_config(run, tiny_dir)
    cfg.learner["max_staleness"] = 3  # one version behind is no fault: the refusal is the news
    policy_dir = tmp_path / "policy"
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=worker_env) as p:

        def publish_version(version: int) -> None:
            publish.publish(
                p.r, p.keys, build_model(seed=version).eval(), build_tokenizer(), policy_dir,
                version=version, step=version, lora=False, keep=10,
            )  # fmt: skip

        def served(version: int, error: bool):
            def check() -> dict | None:
                w = collect(p.r, run)["policy_health"]["workers"].get(worker, {})
                ok = w.get("version") == version and (w.get("error") is not None) == error
                return w if ok and w.get("newest") == (2 if error else 1) else None

            return check

        publish_version(1)
        p.start_workers(rollout=1, verify=0)
        worker = p.procs.procs[0][0]
        honest = wait_for(served(1, error=False), "the worker to serve v1", WAIT_S, every=0.1)
        # v2 as the learner writes and announces it, a byte changed on disk in between
        v2 = publish._write_policy(build_model(seed=2).eval(), build_tokenizer(), policy_dir, 2)
        digests = digest_dir(v2)
        weights = v2 / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x01
        weights.write_bytes(bytes(data))
        pv = PolicyVersion(version=2, step=2, path=str(v2), format="safetensors", digests=digests)
        publish.Publisher()._announce(p.r, p.keys, pv)
        refused = wait_for(served(1, error=True), "the refusal in status", WAIT_S, every=0.1)
        cli = subprocess.run(
            [sys.executable, "-m", "streamrl.cli", "--redis", redis_url, "--run", run, "status"],
            capture_output=True, text=True, env={**worker_env, "COLUMNS": "400"}, timeout=60,
        )  # fmt: skip
        p.stop()
    assert (honest["version"], honest["error"]) == (1, None)
    assert (refused["version"], refused["newest"], refused["lag"]) == (1, 2, 1)
    assert refused["error"].startswith("PolicyIntegrityError: ")
    assert "model.safetensors: sha256 " in refused["error"]
    assert "tampered or truncated" in refused["error"]
    assert cli.returncode == 0, cli.stderr
    assert "PolicyIntegrityError" in cli.stdout and "tampered or truncated" in cli.stdout
