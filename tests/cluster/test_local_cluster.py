"""The local Redis Cluster the tests start (``tests/support/cluster.py``) must come up even
when a port it chose is taken before its node listens there: another test's process can bind
it in between, and a node's port must never be another node's cluster bus port (+10000).
Both once left CI with "local cluster did not come up"."""

from __future__ import annotations

import socket

from tests.support.cluster import LocalCluster, cluster_port


def test_no_port_is_another_nodes_bus_port(monkeypatch):
    """Drawn first: a taken node's bus port (33691), then a port whose bus port is a taken
    node's port (13691); both are passed over."""
    import random

    taken = [23691]
    first = [33691, 13691]
    real = random.Random(0)

    class Draws:
        def randint(self, a: int, b: int) -> int:
            return first.pop(0) if first else real.randint(a, b)

    monkeypatch.setattr("tests.support.cluster.random.Random", Draws)
    port = cluster_port(taken)
    assert not first and port not in (33691, 13691, 23691)


def test_a_port_taken_after_it_was_chosen_is_replaced(tmp_path):
    cluster = LocalCluster(tmp_path, masters=3, replicas=0)
    squatted = cluster.ports[1]
    with socket.socket() as squatter:  # another process listens there first
        squatter.bind(("127.0.0.1", squatted))
        squatter.listen()
        with cluster:
            assert squatted not in cluster.ports and len(set(cluster.ports)) == 3
            client = cluster.client()
            try:
                client.set("k", "v")
                assert client.get("k") == b"v"
            finally:
                client.close()
