"""Workers taking turns updating a policy server (``streamrl.policy.server_update``): a swap
interrupted at any point (a lease ending, a SIGKILL between ``/pause`` and ``/resume``) never
leaves the server paused or locked, and a version the server cannot load is every worker's
reload error without pausing the server on every check.

The server is ``tests.support.openai_server`` (vLLM's dialect, a real model), the clients the
real ``openai`` backend, the locks and hashes a real Redis."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time

import pytest
import redis.asyncio
from safetensors.torch import save_file

from streamrl.bus.keys import Keys
from streamrl.config import RunConfig
from streamrl.models.tiny import build_model
from streamrl.policy import server_update
from streamrl.schema import PolicyVersion, encode
from streamrl.workers.policy_watch import PolicyWatch
from tests.policy.test_openai import make
from tests.support.openai_server import OpenAITestServer
from tests.support.waiting import wait_for

SWAP = ["/pause?mode=wait", "/reset_prefix_cache", "/resume"]


def _version(tmp_path, r, run: str, version: int, valid: bool = True) -> PolicyVersion:
    path = tmp_path / f"v{version}"
    if valid:
        path.mkdir()
        state = {k: v.contiguous() for k, v in build_model(seed=version).state_dict().items()}
        save_file(state, path / "model.safetensors")
    pv = PolicyVersion(version=version, step=version, path=str(path))
    r.xadd(Keys(run).policy, {"p": encode(pv)})
    return pv


def _served(r, server: OpenAITestServer, run: str) -> tuple[dict, bool]:
    """The server's ``served`` hash and whether its update lock is held."""
    policy = make(server.url, redis_url=None, run=run)
    key = Keys(run).served(policy.server_id)
    raw = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
    return raw, bool(r.exists(key + ":lock"))


def _sync(url: str, redis_url: str, run: str, **options):
    return make(url, redis_url=redis_url, run=run, sync="weights", reload_check_s=0, **options)


async def _lease_ends_mid_swap(server, policy, redis_url: str, run: str, grace_s: float) -> None:
    """A lease's policy watch starts a reload on its heartbeat; the lease ends while the server
    is loading (what a rollout lease does at its end: the watch, then the policy's client)."""
    ar = redis.asyncio.Redis.from_url(redis_url)
    watch = PolicyWatch(ar, Keys(run), "w1", asyncio.Event())
    await watch.heartbeat(policy, RunConfig(run=run))
    while "rpc:reload_weights" not in server.events:
        await asyncio.sleep(0.01)
    await watch.aclose(grace_s=grace_s)
    await policy.close()
    await ar.aclose()


@pytest.mark.parametrize(
    ("grace_s", "calls", "version"),
    [(30.0, SWAP, 1), (0.1, ["/pause?mode=wait", "/resume"], None)],
    ids=["the swap finishes", "cancelled past its grace"],
)
def test_a_lease_that_ends_mid_swap_leaves_the_server_resumed_and_unlocked(
    tiny_dir, r, redis_url, tmp_path, run_name, grace_s, calls, version
):
    """The lease's end waits for the reload its heartbeat started: the server is resumed, the
    version recorded and the lock given back; a swap still running after the grace is
    cancelled and still resumes the server and gives the lock back. (Cancelled at once, as
    before, a swap left the server paused and every worker locked out of it for minutes.)"""
    _version(tmp_path, r, run_name, 1)
    with OpenAITestServer(tiny_dir) as server:
        server.rpc_delay_s = 1.0
        policy = _sync(server.url, redis_url, run_name)
        asyncio.run(_lease_ends_mid_swap(server, policy, redis_url, run_name, grace_s))
        served, locked = _served(r, server, run_name)
    assert server.control_calls == calls
    assert policy.version == (version or 0) and policy.reload_error is None
    assert served.get("version") == (str(version) if version else None), served
    assert "paused" not in served and not locked


def test_workers_killed_mid_swap_leave_the_server_to_the_next(
    tiny_dir, r, redis_url, tmp_path, run_name, subprocess_env
):
    """SIGKILL of the updating process at a random moment between its ``/pause`` and its
    ``/resume``, three times: each time the next worker resumes the server once the dead
    one's lock expires, then loads the version itself."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with OpenAITestServer(tiny_dir) as server:
        for version in (1, 2, 3):
            _version(tmp_path, r, run_name, version)
            server.rpc_delay_s = 1.0
            calls = len(server.control_calls)
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.server_updater",
                 server.url, redis_url, run_name, "1.0"],
                env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                wait_for(lambda n=calls: "/pause?mode=wait" in server.control_calls[n:],
                         "the updater's /pause", 60, every=0.01)  # fmt: skip
                time.sleep(rng.uniform(0.0, 0.9))  # in /pause .. the load .. before /resume
                paused, locked = _served(r, server, run_name)
                proc.send_signal(signal.SIGKILL)
            finally:
                proc.kill()
                out, err = proc.communicate(timeout=30)
            assert paused.get("paused") == "updater" and locked, (seed, paused, err[-2000:])
            assert b"synced" not in out, f"seed {seed}: the swap ended before the kill"
            server.rpc_delay_s = 0.0
            nxt = _sync(server.url, redis_url, run_name, update_lock_s=1.0)

            async def until_synced(policy=nxt, version=version):
                while policy.version != version:
                    await policy.refresh()
                    await asyncio.sleep(0.05)
                await policy.close()

            asyncio.run(asyncio.wait_for(until_synced(), 60))
            after = server.control_calls[calls:]
            served, locked = _served(r, server, run_name)
            # the dead one's pause, the next worker's resume, then its own whole swap
            assert after == ["/pause?mode=wait", "/resume", *SWAP], (seed, after)
            assert served["version"] == str(version) and "paused" not in served, (seed, served)
            assert not locked, seed


def test_a_pause_whose_lock_expires_after_the_read_is_resumed_before_the_next_swap(
    tiny_dir, r, redis_url, tmp_path, run_name
):
    """The window the kill test above hit once in a suite run (seed 1320763135): the next
    worker read the dead one's ``paused`` while its lock still held, and took the lock for its
    own swap just after it expired. That swap now resumes the abandoned pause first, as a
    worker that finds the lock free does, instead of folding it into its own pause."""
    pv = _version(tmp_path, r, run_name, 1)
    with OpenAITestServer(tiny_dir) as server:
        policy = _sync(server.url, redis_url, run_name)
        key = Keys(run_name).served(make(server.url, redis_url=None, run=run_name).server_id)

        async def main():
            policy._conn()
            r.hset(key, "paused", "a-worker-killed-mid-swap")  # and its lock gone
            await policy._update_server(pv)
            await policy.close()

        asyncio.run(main())
        served, locked = _served(r, server, run_name)
    assert server.control_calls == ["/resume", *SWAP]
    assert served["version"] == "1" and "paused" not in served and not locked


def test_a_version_the_server_cannot_load_is_every_workers_error_and_not_asked_again(
    tiny_dir, r, redis_url, tmp_path, run_name
):
    _version(tmp_path, r, run_name, 1, valid=False)
    with OpenAITestServer(tiny_dir) as server:
        workers = [_sync(server.url, redis_url, run_name, load_retry_s=3600) for _ in range(2)]

        async def refresh_all(times: int) -> list[tuple[int, str | None]]:
            for _ in range(times):
                for policy in workers:
                    await policy.refresh()
            return [(p.version, p.reload_error) for p in workers]

        async def main():
            failed = await refresh_all(5)
            one_try = list(server.events)
            workers[1].load_retry_s = 0.0  # its window over: this worker asks once more
            await refresh_all(1)
            retried = list(server.events)
            _version(tmp_path, r, run_name, 2)
            loaded = await refresh_all(1)
            for policy in workers:
                await policy.close()
            return failed, one_try, retried, loaded

        failed, one_try, retried, loaded = asyncio.run(main())
        served, locked = _served(r, server, run_name)
    assert one_try.count("/pause") == 1  # one swap (its load retried inside it), not five
    for version, error in failed:
        assert version == 0
        assert error is not None and "PolicyError: loading policy v1 from" in error, error
        assert "FileNotFoundError" in error and str(tmp_path / "v1") in error, error
    assert retried.count("/pause") == 2
    # the next version loads, and no worker reports the old failure any more
    assert loaded == [(2, None), (2, None)]
    assert served["version"] == "2" and "failed" not in served and "error" not in served
    assert not locked


def test_a_new_lease_reports_the_version_its_server_serves_beside_a_failed_newer_one(
    tiny_dir, r, redis_url, tmp_path, run_name
):
    """A lease's client starts at version 0. When the newest version is one its server failed
    to load, it still takes the version the server serves (it once stayed at 0, two behind in
    policy health where the server was one behind)."""
    _version(tmp_path, r, run_name, 1)
    with OpenAITestServer(tiny_dir) as server:

        async def main() -> tuple[int, str | None, tuple[int, str | None]]:
            first = _sync(server.url, redis_url, run_name, load_retry_s=3600)
            await first.refresh()  # loads version 1 into the server
            loaded = first.version
            _version(tmp_path, r, run_name, 2, valid=False)
            await first.refresh()  # fails, and the failure is recorded for the server
            failed = first.reload_error
            await first.close()
            later = _sync(server.url, redis_url, run_name, load_retry_s=3600)  # a new lease
            await later.refresh()
            state = (later.version, later.reload_error)
            await later.close()
            return loaded, failed, state

        loaded, failed, (version, error) = asyncio.run(main())
    assert loaded == 1
    assert failed is not None and "loading policy v2" in failed, failed
    assert version == 1
    assert error is not None and "loading policy v2" in error, error


def test_served_records_parse_and_failures_expire():
    raw = {b"version": b"3", b"model": b"policy", b"failed": b"4", b"error": b"E: x",
           b"failed_at": b"100.0", b"paused": b"w1"}  # fmt: skip
    served = server_update.Served.parse(raw)
    assert (served.version, served.model, served.paused) == (3, "policy", "w1")
    assert served.failure(4, retry_s=30, now=129.0) == "E: x"
    assert served.failure(4, retry_s=30, now=130.0) is None
    assert served.failure(5, retry_s=30, now=101.0) is None
    assert server_update.Served.parse({}) == server_update.Served()
