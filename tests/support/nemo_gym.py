"""The test resources server as a real process on a free port, and NeMo Gym rows for it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent

COUNTER_TOOLS = [
    {
        "type": "function",
        "name": "increment_counter",
        "description": "Add count to the session's counter.",
        "parameters": {
            "type": "object",
            "properties": {"count": {"type": "integer"}},
            "required": ["count"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_counter_value",
        "description": "The counter's value.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        "strict": True,
    },
    {
        "type": "function",
        "name": "kv_set",
        "description": "Store a value under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
            "required": ["key", "value"],
        },
    },
    {
        "type": "function",
        "name": "kv_get",
        "description": "The value stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
        },
    },
]

TICKET_TOOL = {
    "type": "function",
    "name": "draw_ticket",
    "description": "A new random ticket.",
    "parameters": {"type": "object", "properties": {}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sessions(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/_sessions", timeout=10) as resp:
        return json.loads(resp.read())


def by_label(url: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for record in sessions(url).values():
        out.setdefault(record["label"], []).append(record)
    return out


@contextlib.contextmanager
def resources_server(log_dir: Path, protocol: str = "mixed", model_url: str = "") -> Iterator[str]:
    """Start the server in its own process; stop it (by its PID) on the way out.
    ``protocol``: which seeds it takes (tests/support/nemo_gym_server.py); ``model_url``: it
    also serves ``/run``, an environment server whose agent calls the model there."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "resources-server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.nemo_gym_server",
            "--port",
            str(port),
            "--protocol",
            protocol,
            *(["--model-url", model_url] if model_url else []),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def answers() -> bool:
            try:
                sessions(url)
            except OSError:
                assert proc.poll() is None, (log_dir / "resources-server.log").read_text()
                return False
            return True

        wait_for(answers, "the resources server to start", 60, every=0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def counter_row(
    label: str,
    start: int,
    adds: list[int],
    fault: str = "",
    extra_calls: list[dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A NeMo Gym row: add each number to the counter, then answer the value. Its
    ``reference_output`` is what a correct agent does (the scripted policy replays it)."""
    expected = start + sum(adds)
    calls = [
        {"name": "increment_counter", "arguments": json.dumps({"count": n})} for n in adds
    ] + list(extra_calls or [])
    output: list[dict[str, Any]] = []
    for i, c in enumerate(calls):
        output.append({"type": "function_call", "call_id": f"call_{i}", **c})
        output.append({"type": "function_call_output", "call_id": f"call_{i}", "output": "?"})
    output.append(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": str(expected), "annotations": []}],
        }
    )
    return {
        "id": label,
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "Use the tools."},
                {
                    "role": "user",
                    "content": f"The counter starts at {start}. Add {adds} and say the value.",
                },
            ],
            "tools": COUNTER_TOOLS,
            "temperature": 1.0,
        },
        "label": label,
        "initial_count": start,
        "expected_count": expected,
        "fault": fault,
        "reference_output": output,
        **fields,
    }


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
