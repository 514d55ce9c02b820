"""Many clients on one real vLLM server (the session's ``vllm`` fixture): the bound
``max_inflight_per_server`` holds across processes, measured on the server (vLLM's own gauges
of running and queued requests), and the slots of a process killed mid-request come back when
their leases end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(1200)  # the first vLLM test may wait for its start-up

BOUND, LEASE_S = 2, 2.0


def _client(vllm, redis_url: str, run: str, env: dict, seconds: float) -> subprocess.Popen:
    args = [vllm.url, redis_url, run, str(BOUND), str(LEASE_S), "4", str(seconds)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.slot_client", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_bound_holds_across_processes_and_a_killed_holders_slots_come_back(
    vllm, r, redis_url, run_name, subprocess_env
):
    samples: list[tuple[float, int, int]] = []  # (time, vLLM running + queued, leases in Redis)
    stop = threading.Event()
    slots_key: list[bytes] = []

    errors: list[str] = []  # the sampler's, said if a wait gives up

    def sample() -> None:
        while not stop.is_set():
            try:
                if not slots_key:
                    slots_key[:] = list(r.scan_iter(f"srl:{{{run_name}}}:served:*:slots"))[:1]
                leases = r.zcard(slots_key[0]) if slots_key else 0
                samples.append((time.monotonic(), vllm.requests_on_server(), leases))
            except Exception as e:  # a slow /metrics on a loaded machine: the next one counts
                errors.append(repr(e))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # the clients outlive every wait below (the test kills one and stops the other): with 60 s
    # of requests, a slow start on a loaded machine once left the survivor finished (exit code
    # 0, 74 turns) before the victim was killed, so nothing was on the server after it
    victim = _client(vllm, redis_url, run_name, subprocess_env, 600)
    survivor = _client(vllm, redis_url, run_name, subprocess_env, 600)
    try:
        for p in (victim, survivor):
            assert p.stdout is not None and p.stdout.readline().strip() == "started"
        tag = f"-{victim.pid}-".encode()

        def victims() -> int:
            return sum(tag in m for m in r.zrange(slots_key[0], 0, -1)) if slots_key else 0

        def seen() -> str:
            peak = max((s[1] for s in samples), default=0)
            return (f"the killed client holding a slot and {BOUND} requests on the server "
                    f"(killed client's slots {victims()}, server peak {peak} over {len(samples)} "
                    f"samples, sampler errors {errors[-3:]})")  # fmt: skip

        wait_for(lambda: victims() > 0 and max((s[1] for s in samples), default=0) >= BOUND,
                 seen, timeout=120)  # fmt: skip
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        wait_for(lambda: victims() == 0, "the killed client's slots never came back", 10)
        freed_after = time.monotonic() - killed_at
        after = killed_at + freed_after
        try:
            wait_for(lambda: max((s[1] for s in samples if s[0] > after), default=0) >= BOUND,
                     "the survivor never used the freed slots", 30)  # fmt: skip
        except AssertionError as e:  # what was seen, for the next time it happens
            seen = [(round(t - after, 2), n, held) for t, n, held in samples if t > after]
            exited = survivor.poll()
            survivor.kill()
            tail = survivor.communicate(timeout=30)[0][-2000:]
            raise AssertionError(
                f"{e}; (s after freed, on server, leases): {seen[-40:]}; "
                f"survivor exit code before the kill: {exited}; its output: {tail}"
            ) from e
        survivor.terminate()  # its loops end after their requests; it reports
        out, _ = survivor.communicate(timeout=120)
    finally:
        stop.set()
        for p in (victim, survivor):
            if p.poll() is None:
                p.kill()
                p.wait()
        sampler.join(timeout=30)
    result = json.loads(out.strip().splitlines()[-1])
    on_server = [s[1] for s in samples]
    leases = [s[2] for s in samples]
    print(f"samples {len(samples)}, server peak {max(on_server)}, leases peak {max(leases)}, "
          f"slots freed {freed_after:.1f} s after the kill, survivor {result}")  # fmt: skip
    assert max(on_server) == BOUND, on_server  # reached, never passed
    assert max(leases) <= BOUND
    assert freed_after < LEASE_S + 2.0
    assert result["turns"] > 0 and result["waited_s"] > 0
