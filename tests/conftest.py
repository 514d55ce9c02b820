"""Shared fixtures: a private redis-server per test session on a free port (never 6379)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import redis

from streamrl.local.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        assert server.port != 6379
        yield server


_runs = itertools.count()


@pytest.fixture
def redis_url(redis_server):
    """A clean database view: each test gets the server flushed."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def run_name():
    return f"t{next(_runs)}"


@pytest.fixture
def subprocess_env():
    """Environment for real worker processes: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["STREAMRL_PYTHON"] = sys.executable
    return env


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real three-master Redis Cluster on free ports (tests/support/cluster.py)."""
    import shutil

    from tests.support.cluster import LocalCluster

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is needed to create a local Redis Cluster (it ships with Redis)")
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        assert 6379 not in cluster.ports
        yield cluster


@pytest.fixture
def cluster_urls(redis_cluster, redis_url):
    """(data URL on the flushed cluster, control URL on the flushed plain Redis for rq)."""
    redis_cluster.flush()
    return redis_cluster.url, redis_url


@pytest.fixture(scope="session")
def openenv_server(tmp_path_factory):
    """A real OpenEnv server, shared by the session's tests: the echo environment `openenv init`
    writes from openenv-core's template, unchanged (one session at a time), served by the
    package in its own process and virtualenv (tests/support/openenv_server.py)."""
    from tests.support.openenv_server import Server, echo_env, python_or_skip

    python_or_skip()
    where = tmp_path_factory.mktemp("openenv")
    with Server(echo_env(where), log=where / "server.log") as server:
        yield server


# ---------------------------------------------------------------------- the real vLLM server

_vllm: dict = {}


def _needs_vllm(item) -> bool:
    return bool({"vllm", "vllm2"} & set(getattr(item, "fixturenames", ())))


TWO_VLLM = "STREAMRL_TEST_TWO_VLLM"  # opt-in: a second server (see tests/support/vllm.py)


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """One process: tests on the real vLLM server run last, so the suite runs while it starts
    in the background. Under ``pytest -n`` (``make test``): they are one group, run by one
    worker, which starts the server when the group's first test asks for it while the other
    worker runs the rest of the suite. The group comes first there: the scheduler hands out
    work in this order, and the group last (~7 minutes in one piece on a 2.1-GHz Xeon) left
    the other worker idle for the suite's last minutes (the machine ~45 % idle)."""
    vllm = [i for i in items if _needs_vllm(i)]
    rest = [i for i in items if not _needs_vllm(i)]
    if _xdist_worker():
        for item in vllm:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        items[:] = vllm + sorted(rest, key=_long_first)  # a stable sort: the rest keep order
    else:
        items[:] = rest + vllm


# The suite's longest tests outside the vLLM group (10-61 s each on the 2-core test machine,
# `pytest --durations`, 2026-11-27), longest first. Under -n 2 they are handed out first, so
# that short tests fill the end: scheduled as collected, some came last and the machine sat
# 30-50 % idle for the suite's last five minutes.
_LONG_FIRST = [
    "tests/workers/test_self_healing.py::test_random_kills_and_a_redis_restart_lose_nothing",
    "tests/cluster/test_failover.py::test_every_role_rides_out_a_master_failover",
    "tests/local/test_demo.py::test_demo_trains_and_rollouts_follow_new_policy_versions",
    "tests/learner/test_restart.py::test_sigkilled_learner_matches_uninterrupted_run",
    "tests/cluster/test_failover.py::test_a_data_parallel_learner_rides_out_a_master_failover",
    "tests/evaluation/test_audit.py::test_builtin_environments_pass",
    "tests/learner/test_data_parallel.py::test_sigkilled_rank_stops_the_job_and_restart_loses_",
    "tests/test_redis_restart.py::test_every_role_rides_out_redis_restarts",
    "tests/learner/test_disk_full.py::test_a_full_disk_stops_the_learner_cleanly",
    "tests/learner/test_data_parallel.py::test_sharded_ranks_match_one_process",
    "tests/test_bring_your_env.py::test_openenv_server_and_rollouts",
    "tests/test_docs.py::test_commands_are_real",
    "tests/workers/test_policy_health.py::test_a_worker_that_cannot_load_the_policy_faults",
    "tests/workers/test_openenv_pipeline.py::",
    "tests/workers/test_nemo_gym_exactly_once.py::",
    "tests/workers/test_judge_pipeline.py::",
    "tests/workers/test_self_healing.py::",
    "tests/test_redis_oom.py::",
    "tests/workers/test_session_expiry.py::",
    "tests/test_acl.py::",
    "tests/local/test_demo.py::test_sigterm_stops_the_demo",
]


def _long_first(item: pytest.Item) -> int:
    for rank, prefix in enumerate(_LONG_FIRST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(_LONG_FIRST)


def _start_vllm(session) -> None:
    if "session" in _vllm or not any(_needs_vllm(i) for i in session.items):
        return
    from tests.support.vllm import SessionVLLM

    _vllm["session"] = SessionVLLM()  # venv, model and start-up in a background thread
    wanted = any("vllm2" in getattr(i, "fixturenames", ()) for i in session.items)
    if wanted and (os.environ.get(TWO_VLLM) == "1" or os.environ.get("STREAMRL_TEST_VLLM2_URL")):
        cpus = "1" if (os.cpu_count() or 1) > 1 else "0"
        _vllm["second"] = SessionVLLM("STREAMRL_TEST_VLLM2_URL", cpus=cpus)


def pytest_collection_finish(session):
    if not session.config.option.collectonly and not _xdist_worker():
        _start_vllm(session)


def pytest_sessionfinish(session, exitstatus):
    for name in ("session", "second"):
        if name in _vllm:
            _vllm.pop(name).stop()


def _shared_vllm(name: str):
    from streamrl.local.vllm import VLLMCannotInstall

    try:
        shared = _vllm[name].get()
    except VLLMCannotInstall as e:  # no Python 3.11 or no package index: not streamrl's fault
        pytest.skip(f"no vLLM on this machine: {e}")
    if shared.server is not None and not shared.server.alive():
        shared.server.restart().wait_ready()  # a fault test killed it
    shared.reset()
    return shared


def _grouped(request) -> None:
    """Under ``--dist loadgroup`` a vLLM test's node id carries its group: without it, both
    workers run vLLM tests, each starting a server of its own on a 2-core machine (the CI ran
    24 minutes and a test starved)."""
    loadgroup = _xdist_worker() and request.config.getvalue("loadgroup")
    if loadgroup and not request.node.nodeid.endswith("@vllm"):
        pytest.fail(
            f"pytest {pytest.__version__} ignores pytest-xdist's xdist_group: this vLLM test "
            "is not in the vllm group, so both workers would start a vLLM server. pytest 9.2 "
            "reads node ids from a field xdist 3.8 does not rewrite; install pytest<9.2 "
            "(pyproject.toml pins it)",
            pytrace=False,
        )


@pytest.fixture
def vllm(request):
    """The session's vLLM server (tests/support/vllm.py), on the base weights and serving."""
    _grouped(request)
    if _xdist_worker():
        _start_vllm(request.session)  # the worker that runs the vLLM group starts it
    if "session" not in _vllm:
        pytest.skip("the vLLM server is started only when collection selects a vLLM test")
    return _shared_vllm("session")


@pytest.fixture
def vllm2(request):
    """A second vLLM server, beside ``vllm``: opt-in, its start-up does not fit the CI."""
    _grouped(request)
    if _xdist_worker():
        _start_vllm(request.session)
    if "second" not in _vllm:
        pytest.skip(
            f"a second vLLM server (87 s to start here, on a busy 2-core machine) and this "
            f"test (~70 s) are over the CI's budget: set {TWO_VLLM}=1 (or "
            "STREAMRL_TEST_VLLM2_URL) to run it"
        )
    return _shared_vllm("second")
