"""A real local Redis Cluster for tests: three masters on free loopback ports, no replicas,
created with ``redis-cli --cluster create``; every server is stopped by its PID."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import redis

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
    """A free port whose cluster bus port (+10000) is free too; Redis needs it <= 55535."""
    rng = random.Random()
    while True:
        port = rng.randint(20000, 45000)
        if port != 6379 and port not in taken and _bindable(port) and _bindable(port + 10000):
            return port


class LocalCluster:
    def __init__(self, directory: str | Path, masters: int = 3):
        self.directory = Path(directory)
        self.ports: list[int] = []
        for _ in range(masters):
            self.ports.append(cluster_port(self.ports))
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        """What streamrl is given: any node's address under the cluster scheme."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> LocalCluster:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed for a local cluster")
        for port in self.ports:
            d = self.directory / str(port)
            d.mkdir(parents=True, exist_ok=True)
            args = [
                exe,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(d.resolve()),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000",
                "--save", "",
                "--appendonly", "no",
                "--logfile", "redis.log",
                "--daemonize", "no",
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)
            )
        for port in self.ports:
            self._wait(lambda p=port: redis.Redis(port=p, socket_connect_timeout=0.5).ping())
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=START_TIMEOUT_S,
        )
        for port in self.ports:
            self._wait(lambda p=port: self._state_ok(p))
        return self

    @staticmethod
    def _state_ok(port: int) -> bool:
        info = redis.Redis(port=port).execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def _wait(self, check) -> None:
        try:
            wait_for(check, "the local cluster", START_TIMEOUT_S, (redis.RedisError,))
        except AssertionError as e:
            self.stop()
            raise RuntimeError(f"local cluster did not come up; logs in {self.directory}") from e

    def node_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        client = redis.RedisCluster(host="127.0.0.1", port=self.ports[0])
        try:
            return client.get_node_from_key(key).port
        finally:
            client.close()

    def flush(self) -> None:
        for port in self.ports:
            redis.Redis(port=port).flushall()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        for p in self.procs:
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
