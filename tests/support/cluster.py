"""A real local Redis Cluster for tests: masters (and, if asked, one or more replicas each) on
free loopback ports, created with ``redis-cli --cluster create``; every server is started
and stopped by its PID. ``kill_master_of`` SIGKILLs the master serving a key, for failover
tests."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.waiting import wait_for

START_TIMEOUT_S = 30.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port(taken: list[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis needs it <= 55535.
    Neither may be a port or a bus port of a node already ``taken``: a node whose port was
    another's bus port could not listen (seen in CI: "bind: Address already in use")."""
    rng = random.Random()
    used = {*taken, *(t + 10000 for t in taken)}
    while True:
        port = rng.randint(20000, 45000)
        if port == 6379 or port in used or port + 10000 in used:
            continue
        if _bindable(port) and _bindable(port + 10000):
            return port


def _text(reply: object) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each; ``node_timeout_ms`` is the
    ``cluster-node-timeout`` (how long a master may be silent before its replica takes over)."""

    def __init__(
        self,
        directory: str | Path,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
        extra_args: tuple[str, ...] = (),
    ):
        self.directory = Path(directory)
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(cluster_port(self.ports))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """What streamrl is given: every node's address under the cluster scheme (any one
        would do while it is up; the list lets a client start while one is down)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start_node(self, port: int) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        d = self.directory / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [
            exe,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(d.resolve()),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--save", "",
            "--appendonly", "no",
            "--logfile", "redis.log",
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)

    def start(self) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if shutil.which("redis-server") is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed for a local cluster")
        for port in self.ports:
            self._start_node(port)
        for i in range(len(self.ports)):
            self._up(i)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=START_TIMEOUT_S,
        )
        for port in self.ports:
            self._wait(lambda p=port: self._settled(p))
        return self

    @staticmethod
    def _answers(port: int, pid: int) -> bool:
        """The server on ``port`` is the node started as ``pid`` (not another one that took
        the port). Half a second and no retries: a process that took the port may accept and
        never answer, and redis-py 8's defaults (5 s, retried) outlasted the start timeout."""
        node = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=0.5,
                           retry=Retry(NoBackoff(), 0))  # fmt: skip
        try:
            return int(node.info("server")["process_id"]) == pid
        finally:
            node.close()

    def _up(self, i: int) -> None:
        """Node ``i`` answers. One that could not listen on its port (another process took it
        after it was chosen: "Address already in use") is started again on another, twice at
        most; one that exited for any other reason fails the start."""
        for _ in range(3):
            port = self.ports[i]
            proc = self.procs[port]
            self._wait(lambda p=port, q=proc: q.poll() is not None or self._answers(p, q.pid))
            if proc.poll() is None:
                return
            log = self.directory / str(port) / "redis.log"
            if "Address already in use" not in (log.read_text(errors="replace") if log.exists()
                                                else ""):  # fmt: skip
                break
            del self.procs[port]
            self.ports[i] = cluster_port(self.ports[:i] + self.ports[i + 1 :])
            self._start_node(self.ports[i])
        self.stop()
        raise RuntimeError(f"a node of the local cluster exited; logs in {self.directory}")

    def _settled(self, port: int) -> bool:
        """The node sees the cluster as ok and knows every node, each replica as one; a
        replica has finished its first sync (else it would refuse to take over, its data
        being too old)."""
        node = redis.Redis(port=port)
        if "cluster_state:ok" not in _text(node.execute_command("CLUSTER", "INFO")):
            return False
        replication = node.info("replication")
        if replication["role"] == "slave" and replication["master_link_status"] != "up":
            return False
        nodes = _text(node.execute_command("CLUSTER", "NODES")).strip().splitlines()
        replicas = sum(1 for n in nodes if "slave" in n.split()[2])
        return len(nodes) == len(self.ports) and replicas == len(self.ports) - self.masters

    def _wait(self, check) -> None:
        try:
            wait_for(check, "the local cluster", START_TIMEOUT_S, (redis.RedisError,))
        except AssertionError as e:
            self.stop()
            raise RuntimeError(f"local cluster did not come up; logs in {self.directory}") from e

    def client(self) -> redis.RedisCluster:
        live = [p for p in self.ports if self.procs[p].poll() is None]
        return redis.RedisCluster(host="127.0.0.1", port=live[0])

    def node_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        client = self.client()
        try:
            return client.get_node_from_key(key).port
        finally:
            client.close()

    def replica_of(self, port: int) -> int:
        """The port of a replica of the master on ``port``."""
        me = _text(redis.Redis(port=port).execute_command("CLUSTER", "MYID")).strip()
        for line in _text(redis.Redis(port=port).execute_command("CLUSTER", "NODES")).splitlines():
            fields = line.split()
            if "slave" in fields[2] and fields[3] == me:
                return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        raise AssertionError(f"the master on port {port} has no replica")

    def role(self, port: int) -> str:
        return _text(redis.Redis(port=port, socket_connect_timeout=0.5).role()[0])

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: no goodbye to the cluster)."""
        os.kill(self.procs[port].pid, signal.SIGKILL)
        self.procs[port].wait()

    def kill_master_of(self, key: str, timeout: float = 120.0) -> tuple[int, int, float]:
        """SIGKILL the master serving ``key`` and wait until its replica has taken over and the
        cluster is ok again. Returns (killed port, promoted port, seconds from the kill to the
        promotion as seen from here)."""
        master = self.node_of(key)
        replica = self.replica_of(master)
        self.kill(master)
        killed_at = time.monotonic()
        self.wait_promoted(replica, master, timeout)
        return master, replica, time.monotonic() - killed_at

    def wait_promoted(self, replica: int, master: int, timeout: float = 120.0) -> None:
        """Until ``replica`` is a master and sees the cluster ok."""
        wait_for(
            lambda: self.role(replica) == "master" and self._state_ok(replica),
            f"replica {replica} to take over from {master}",
            timeout,
            (redis.RedisError,),
            every=0.02,
        )

    def _state_ok(self, port: int) -> bool:
        info = redis.Redis(port=port).execute_command("CLUSTER", "INFO")
        return "cluster_state:ok" in _text(info)

    def flush(self) -> None:
        for port, proc in self.procs.items():
            if proc.poll() is None and self.role(port) == "master":
                redis.Redis(port=port).flushall()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
