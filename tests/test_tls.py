"""Redis over TLS (``rediss://``): certificates made here with the openssl CLI, a redis-server
serving TLS only, and the pipeline run through it (producer, real rq rollout and verify workers,
``streamrl status``) with every prompt once; a client that does not trust the server's
certificate stops with one ``Error:`` line."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from streamrl import schema
from streamrl.bus.streams import xrange_all
from streamrl.config import PolicyConfig, RunConfig
from streamrl.connection import connect
from streamrl.envs import make_env
from streamrl.local.embedded import free_port
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer

RUN = "tls"
PROMPTS, GROUP = 16, 4


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(d: Path) -> None:
    """A CA, and a server certificate it signs for 127.0.0.1 and localhost."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=streamrl test CA", "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt",
             cwd=d)  # fmt: skip


@pytest.fixture
def tls_redis(tmp_path):
    """redis-server with TLS on, plain TCP off; its port and the CA certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI (apt-get install openssl)")
    d = tmp_path / "tls"
    d.mkdir()
    _certificates(d)
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
            "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(d),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.crt'}"
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:  # a build without TLS says so here
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            pytest.skip(f"redis-server cannot serve TLS here: {out[-500:]}")
        try:
            if redis.Redis.from_url(url, socket_connect_timeout=0.5).ping():
                break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    yield port, d / "ca.crt"
    proc.terminate()
    proc.wait(10)


def test_the_pipeline_runs_over_tls(tls_redis, tmp_path, subprocess_env):
    port, ca = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    with pytest.raises(redis.ConnectionError):  # TLS only: no plain Redis on that port
        redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=2).ping()
    cfg = RunConfig(run=RUN, env="counter", group_size=GROUP, policy=PolicyConfig(wrong_rate=0.0))
    with LocalPipeline(cfg, url=url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        Producer(connect(url, resilient=True), RUN).from_env(make_env("counter"), PROMPTS, GROUP)
        p.wait_groups(PROMPTS, timeout=120)
        acc = p.account(task_ids("counter", 0, PROMPTS, GROUP))
        per_prompt = Counter(
            schema.GROUP.decode(f[b"p"]).prompt_id for _, f in xrange_all(p.r, p.keys.groups)
        )
        cli = [sys.executable, "-m", "streamrl.cli", "--run", RUN, "status", "--json"]
        trusted = subprocess.run(
            [*cli[:3], "--redis", url, *cli[3:]], capture_output=True, text=True,
            env=subprocess_env, timeout=60,
        )  # fmt: skip
        untrusted_url = f"rediss://127.0.0.1:{port}/0"  # the system's CAs: not ours
        untrusted = subprocess.run(
            [*cli[:3], "--redis", untrusted_url, *cli[3:]], capture_output=True, text=True,
            env=subprocess_env, timeout=60,
        )  # fmt: skip
        p.stop()

    assert (acc.lost, acc.duplicated, acc.failures) == (0, 0, 0)
    assert acc.scored == PROMPTS * GROUP
    assert len(per_prompt) == PROMPTS and set(per_prompt.values()) == {1}
    assert trusted.returncode == 0, trusted.stderr
    assert '"groups_completed"' in trusted.stdout or str(PROMPTS) in trusted.stdout
    assert untrusted.returncode == 1
    assert "Traceback" not in untrusted.stderr
    lines = untrusted.stderr.strip().splitlines()
    assert len(lines) == 1, untrusted.stderr
    assert lines[0].startswith("Error: ")
    assert "certificate verify failed" in lines[0]
