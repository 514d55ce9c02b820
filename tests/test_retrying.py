"""Redis Cluster clients whose retries pause: a resilient client rides out a master failover
on a real cluster with replicas (commands, pipelines, the asyncio client), and cluster URLs
may list several nodes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from streamrl.connection import check_url, connect, connect_async, reach
from streamrl.retrying import cluster_parts
from tests.support.cluster import LocalCluster
from tests.support.waiting import wait_for

KEY = "srl:{fo}:k"


def test_cluster_urls_name_one_node_or_several():
    assert cluster_parts("redis+cluster://127.0.0.1:7000") == ("redis://127.0.0.1:7000", [])
    assert cluster_parts("rediss+cluster://u:p@w@h1:7000,h2:7001,[::1]:7002,h4/0?a=1") == (
        "rediss://u:p@w@h1:7000/0?a=1",
        [("h2", 7001), ("::1", 7002), ("h4", 6379)],
    )
    with pytest.raises(ValueError, match="'h2:x' in a Redis Cluster URL is not HOST:PORT"):
        check_url("redis+cluster://:secret@h1:1,h2:x")


@pytest.fixture
def failing_over(tmp_path):
    """Three masters with a replica each, a 2 s node timeout, and a thread that SIGKILLs the
    master serving KEY once started: ``(cluster, start, done)``; ``done()`` returns
    (killed, promoted, seconds to the promotion) once the replica has taken over."""
    with LocalCluster(tmp_path, masters=3, replicas=1, node_timeout_ms=2000) as cluster:
        result: dict = {}
        killer = threading.Thread(target=lambda: result.update(kill=cluster.kill_master_of(KEY)))

        def done():
            return result.get("kill")

        yield cluster, killer.start, done
        killer.join(timeout=120)


def _replicated(r, key: str) -> None:
    """Wait until the replica of ``key``'s master has every write so far: Redis replicates
    asynchronously, and what a killed master had not passed on is lost in any failover."""
    assert r.execute_command("WAIT", 1, 10_000, target_nodes=r.get_node_from_key(key)) == 1


def test_resilient_cluster_client_rides_out_a_master_failover(failing_over):
    cluster, kill, done = failing_over
    r = connect(cluster.url, resilient=True)
    r.set(KEY, "v")
    _replicated(r, KEY)
    kill()
    rounds = 0
    while not done():  # every command during the outage waits for the replica, then works
        assert r.get(KEY) == b"v"
        pipe = r.pipeline(transaction=False)
        pipe.get(KEY).incr("srl:{fo}:n").get("srl:{other}:k")
        got, n, _ = pipe.execute()
        assert got == b"v" and n >= 1
        # errors handed back as replies: a stream that does not exist, yes; the outage, no
        pipe = r.pipeline(transaction=False)
        got, missing = pipe.get(KEY).xinfo_stream("srl:{fo}:none").execute(raise_on_error=False)
        assert got == b"v" and isinstance(missing, redis.ResponseError)
        rounds += 1
    killed, promoted, _took = done()
    assert rounds > 0 and r.get_node_from_key(KEY).port == promoted != killed
    assert r.incr("srl:{fo}:n") >= 1 and r.get(KEY) == b"v"


def test_a_pipeline_cut_by_the_failover_is_sent_again(failing_over):
    """The master dies while a pipeline waits on its reply: redis-py hands the connection
    errors back as replies when told not to raise (as the producer's readings are, for
    streams that may not exist yet); they must be retried, not returned."""
    cluster, kill, done = failing_over
    r = connect(cluster.url, resilient=True)
    r.set(KEY, "v")
    _replicated(r, KEY)
    pipe = r.pipeline(transaction=False)
    pipe.blpop(["srl:{fo}:list"], timeout=5).get(KEY).xinfo_stream("srl:{fo}:none")
    kill()  # while BLPOP blocks on the master
    popped, got, missing = pipe.execute(raise_on_error=False)
    assert popped is None and got == b"v" and isinstance(missing, redis.ResponseError)
    assert done() is not None  # it was sent again after the replica took over


def test_commands_whose_keys_redis_py_asks_the_default_node_for_survive_losing_it(failing_over):
    """redis-py asks its default node where XREADGROUP's keys are (COMMAND GETKEYS); with
    the dead master as that node, it failed before noticing anything, on every retry."""
    cluster, kill, done = failing_over
    r = connect(cluster.url, resilient=True)
    r.xgroup_create("srl:{fo}:s", "g", id="0", mkstream=True)
    _replicated(r, KEY)
    r.replace_default_node(r.get_node_from_key(KEY))  # the master about to die
    kill()
    rounds = 0
    while not done():
        r.xadd("srl:{fo}:s", {"n": rounds})
        r.xreadgroup("g", "c", {"srl:{fo}:s": ">"}, count=10, block=100)
        rounds += 1
    r.xadd("srl:{fo}:s", {"n": "last"})
    assert r.xreadgroup("g", "c", {"srl:{fo}:s": ">"}, count=rounds + 1)  # it answers
    assert rounds > 0


def test_resilient_async_cluster_client_rides_out_a_master_failover(failing_over):
    cluster, kill, done = failing_over
    sync = connect(cluster.url)
    sync.xgroup_create("srl:{fo}:s", "g", id="0", mkstream=True)
    sync.set(KEY, "v")
    _replicated(sync, KEY)

    async def main() -> int:
        r = connect_async(cluster.url, resilient=True)
        try:
            kill()
            rounds = 0
            while not done():
                await r.xadd("srl:{fo}:s", {"n": rounds})
                await r.xreadgroup("g", "c", {"srl:{fo}:s": ">"}, count=10, block=100)
                assert await r.get(KEY) == b"v"
                rounds += 1
            await r.xadd("srl:{fo}:s", {"n": "last"})
            assert await r.xreadgroup("g", "c", {"srl:{fo}:s": ">"}, count=rounds + 1)
            return rounds
        finally:
            await r.aclose()

    assert asyncio.run(main()) > 0


def test_a_client_starts_while_the_node_in_its_url_is_down(failing_over):
    """A URL that lists several nodes still reaches the cluster when the first is dead; one
    that names only the dead node cannot."""
    cluster, kill, done = failing_over
    r = connect(cluster.url)
    r.set(KEY, "v")
    _replicated(r, KEY)  # else the failover may rightly lose it
    kill()
    wait_for(done, "the failover", 120)
    killed, _promoted, _took = done()
    others = [p for p in cluster.ports if p != killed]
    listed = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in [killed, *others])
    assert reach(listed, retries=3).get(KEY) == b"v"
    with pytest.raises(redis.ConnectionError):
        reach(f"redis+cluster://127.0.0.1:{killed}", retries=1)
