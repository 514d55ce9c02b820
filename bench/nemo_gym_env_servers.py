"""streamrl's ``nemo-gym`` environment with ``mode=run`` against the *environment servers* the
PyPI ``nemo-gym`` 0.7.0 wheel ships, run as they ship (bench/nemo_gym_pypi/env_servers.py, in
``.venv-nemo-gym-0.7``, which tests/support/nemo_gym_venv.py makes), each in its own process,
finding each other through one NeMo Gym global config:

- ``single_agent_turn`` (the environment server) -> ``simple_agent`` (the agent, given direct
  HTTP access to the resources server's tools) -> the model server: streamrl's rollout worker,
  its policy endpoint named ``policy_model`` in the config; seed, verify and close of the
  resources session by the environment server;
- ``legacy_agent`` (relays ``/run`` to an agent's legacy ``/run``, which reads the row) ->
  ``simple_agent`` -> streamrl's endpoint (the rollout path from the row's ``_ng_rollout_id``,
  with ``observability_enabled``).

Resources servers: the wheel's ``example_single_tool_call`` (its own example rows) and the
logging counter of bench/nemo_gym_pypi/servers.py (a ``SimpleResourcesServer`` that takes 0.7's
typed seeds and ``/close_session`` and logs every seed, call, verify and close).

    python bench/nemo_gym_env_servers.py [--prompts 6] [--kills 2]

Parts: ``weather`` (single_agent_turn + example_single_tool_call, 5 rows x 2, no kills);
``counter_single_agent_turn`` and ``counter_legacy_agent`` (``--prompts`` x 2 counter rows,
the rollout worker's work horse SIGKILLed right after answering a model turn ``--kills``
times). ``nemo_user_sim`` is not run: see its entry. Real rq workers, a private Redis, the
scripted policy with token ids. Prints one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl.local.embedded import EmbeddedRedis  # noqa: E402
from streamrl.local.procs import stop_all  # noqa: E402
from tests.support.nemo_gym import COUNTER_TOOLS, counter_row, free_port  # noqa: E402
from tests.support.nemo_gym_kills import run_mode_kill_run  # noqa: E402
from tests.support.nemo_gym_venv import nemo_gym_python  # noqa: E402

HERE = Path(__file__).resolve().parent / "nemo_gym_pypi"
HOST = "127.0.0.1"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _up(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/openapi.json", timeout=5).close()
        return True
    except urllib.error.HTTPError:
        return True  # it answers
    except OSError:
        return False


class Procs:
    """The servers, each in its own process, stopped by PID on the way out."""

    def __init__(self, python: str, tmp: Path) -> None:
        self.python, self.tmp = python, tmp
        self.procs: list[tuple[str, subprocess.Popen, object]] = []

    def start(self, name: str, argv: list[str], port: int) -> str:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([self.python, *argv], stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.tmp)  # fmt: skip
        self.procs.append((name, proc, log))
        return f"http://{HOST}:{port}"

    def wait(self, urls: dict[str, str], timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        for name, url in urls.items():
            while not _up(url):
                proc = next(p for n, p, _ in self.procs if n == name)
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = (self.tmp / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} did not start: {text}")
                time.sleep(0.5)

    def stop(self) -> None:
        stop_all([proc for _, proc, _ in self.procs], grace_s=15.0)  # newest first
        for _, _, log in self.procs:
            log.close()


def global_config(ports: dict[str, int], resources: str) -> dict:
    """NeMo Gym's global config: the resources server (``resources``), the agent, the model
    server (streamrl's endpoint) and both environment servers, by instance name."""
    ref = lambda kind, name: {"type": kind, "name": name}  # noqa: E731
    server = lambda name, **kw: {"host": HOST, "port": ports[name], "entrypoint": "app.py", **kw}  # noqa: E731
    out = {
        "policy_model": {"responses_api_models": {"openai_model": server("policy_model")}},
        "session_agent": {"responses_api_agents": {"simple_agent": server(
            "session_agent", resources_server=ref("resources_servers", "resources"),
            model_server=ref("responses_api_models", "policy_model"))}},
        "single_agent_turn_env": {"environment_servers": {"single_agent_turn": server(
            "single_agent_turn_env", resources_server=ref("resources_servers", "resources"),
            agent_server=ref("responses_api_agents", "session_agent"),
            resources_tool_transports=["direct_http"], cleanup_timeout_seconds=60,
            default_episode_timeout_seconds=300)}},
        "legacy_agent_env": {"environment_servers": {"legacy_agent": server(
            "legacy_agent_env", agent_server=ref("responses_api_agents", "session_agent"))}},
        # legacy_agent's agent carries the row's _ng_rollout_id onto its model calls only with
        # rollout correlation on
        "observability_enabled": True,
    }  # fmt: skip
    out["resources"] = {"resources_servers": {resources: server("resources", domain="agent")}}
    return out


def weather_rows(python: str) -> list[dict]:
    out = subprocess.run(
        [python, "-c", "import resources_servers.example_single_tool_call as m; "
         "print(m.__path__[0])"], capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = Path(out.stdout.strip()) / "data" / "example.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        call = {"type": "function_call", "call_id": "c0", "name": "get_weather",
                "arguments": json.dumps({"city": "San Francisco"})}  # fmt: skip
        text = {"type": "output_text", "text": "It is cold.", "annotations": []}
        answer = {"type": "message", "role": "assistant", "content": [text]}
        row["reference_output"] = [call, answer]
        row.setdefault("id", f"weather-{i}")
    return rows


def counter_rows(prompts: int) -> list[dict]:
    tools = [t for t in COUNTER_TOOLS if "counter" in t["name"]]
    rows = []
    for i in range(prompts):
        row = counter_row(f"c{i:04d}", 3 * i, [i % 5 + 1, 2])
        row["responses_create_params"]["tools"] = tools
        rows.append(row)
    return rows


def chain(python: str, tmp: Path, resources: str) -> tuple[Procs, dict[str, str], str]:
    """The servers around ``resources`` (``weather``: the wheel's example_single_tool_call;
    ``counter`` or ``copy``: bench/nemo_gym_pypi/servers.py's)."""
    names = ("policy_model", "session_agent", "single_agent_turn_env", "legacy_agent_env",
             "resources")  # fmt: skip
    ports = {n: free_port() for n in names}
    impl = {"weather": "example_single_tool_call"}.get(resources, resources)
    config = tmp / f"global-{resources}.json"
    config.write_text(json.dumps(global_config(ports, impl)))
    procs = Procs(python, tmp)
    urls = {}
    try:
        if resources in ("counter", "copy"):  # bench/nemo_gym_pypi/servers.py's
            port = str(ports["resources"])
            argv = [str(HERE / "servers.py"), "--kind", resources, "--port", port]
        else:
            argv = [str(HERE / "env_servers.py"), "--config", str(config), "--name", "resources"]
        urls["resources"] = procs.start("resources", argv, ports["resources"])
        for name in ("session_agent", "single_agent_turn_env", "legacy_agent_env"):
            argv = [str(HERE / "env_servers.py"), "--config", str(config), "--name", name]
            urls[name] = procs.start(name, argv, ports[name])
        procs.wait(urls)
    except BaseException:
        procs.stop()
        raise
    return procs, urls, f"{HOST}:{ports['policy_model']}"


def part(redis_url, env, tmp, name, url, endpoint, rows, kills, sessions_url) -> dict:
    say(f"{name}: {len(rows)} rows x 2, {kills} kills")
    d = tmp / name
    d.mkdir()
    faults = f"after_policy_turn:{kills}" if kills else ""
    t0 = time.monotonic()
    report = run_mode_kill_run(redis_url, url, endpoint, d, env, rows, faults=faults,
                               run=name.replace("_", "-"), sessions_url=sessions_url,
                               timeout_s=300)  # fmt: skip
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def train_part(python: str, tmp: Path, steps: int, seconds: float) -> dict:
    """``streamrl demo``'s training (the tiny Llama, hf backend, one rollout worker) with every
    episode run by single_agent_turn + simple_agent over the copy resources server: the learner
    trains on the turns the policy endpoint recorded."""
    import random

    from streamrl.local.demo import DEMO_CONFIG, DemoOptions, train_demo

    rng = random.Random(1)
    symbols = [chr(ord("a") + i) for i in range(16)]
    rows = []
    for i in range(512):
        answer = [rng.choice(symbols) for _ in range(3)]
        params = {"input": "copy : " + " ".join(answer)}
        rows.append({"id": f"copy{i:05d}", "responses_create_params": params, "answer": answer})
    dataset = tmp / "copy.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    procs, urls, endpoint = chain(python, tmp, "copy")
    try:
        text = Path(DEMO_CONFIG).read_text().replace('env = "copy"', 'env = "nemo-gym"')
        text += (
            f'\n[env_options]\nbase_url = "{urls["single_agent_turn_env"]}"\nrows = "{dataset}"'
            f'\nmode = "run"\npolicy_endpoint = "{endpoint}"\n'
        )
        config = tmp / "copy-run.toml"
        config.write_text(text)
        opts = DemoOptions(
            seconds=seconds, target=None, live=False, config=config, max_steps=steps,
            directory=tmp / "copy-run", rollout_workers=1,
        )  # fmt: skip
        res = train_demo(opts)
        verifies = json.loads(urllib.request.urlopen(f"{urls['resources']}/_sessions").read())
    finally:
        procs.stop()
    keep = ("reward_first", "reward_last", "learner_steps", "seconds", "groups_trained")
    out = {k: res.get(k) for k in keep}
    out["server_verifies"] = verifies.get("verified")
    out["ok"] = (res.get("learner_steps") or 0) >= steps and bool(out["server_verifies"])
    return out


def mode_run_parts(python, tmp, redis_url, worker_env, prompts, kills) -> dict:
    out = {}
    procs, urls, endpoint = chain(python, tmp, "weather")
    try:
        out["weather_single_agent_turn"] = part(
            redis_url, worker_env, tmp, "weather_single_agent_turn",
            urls["single_agent_turn_env"], endpoint, weather_rows(python), 0, None,
        )  # fmt: skip
    finally:
        procs.stop()
    procs, urls, endpoint = chain(python, tmp, "counter")
    try:
        for env_name in ("single_agent_turn", "legacy_agent"):
            out[f"counter_{env_name}"] = part(
                redis_url, worker_env, tmp, f"counter_{env_name}", urls[f"{env_name}_env"],
                endpoint, counter_rows(prompts), kills, urls["resources"],
            )  # fmt: skip
    finally:
        procs.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--workdir", default="", help="keep the servers' logs here (empty: a temp)")
    ap.add_argument("--train-steps", type=int, default=0, help="also train (train_part)")
    ap.add_argument("--seconds", type=float, default=900.0)
    args = ap.parse_args()
    python = nemo_gym_python("0.7.0", say)
    worker_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-nemo-gym-env-") as t:
        tmp = Path(args.workdir or t)
        tmp.mkdir(parents=True, exist_ok=True)
        rs = EmbeddedRedis(tmp / "redis").start()
        try:
            out.update(mode_run_parts(python, tmp, rs.url, worker_env, args.prompts, args.kills))
        finally:
            rs.stop()
        if args.train_steps > 0:
            say(f"copy training through single_agent_turn: {args.train_steps} learner steps")
            out["copy_training"] = train_part(python, tmp, args.train_steps, args.seconds)
    out["nemo_user_sim"] = user_sim(python)
    print(json.dumps(out, indent=2, default=str))
    w, s, legacy = (out[k] for k in ("weather_single_agent_turn", "counter_single_agent_turn",
                                     "counter_legacy_agent"))  # fmt: skip
    ok = (
        w["drained"] and w["scored"] == w["samples"] and w["mean_reward"] == 1.0
        and w["samples_without_tokens"] == 0
        and s["drained"] and s["scored"] == s["samples"] and s["scored_0"] == 0
        and s["calls_applied_twice"] == 0 and s["sessions_not_as_recorded"] == 0
        and s["sessions_leaked"] == 0 and s["scored_twice"] == 0
        and legacy["drained"] and legacy["scored"] == legacy["samples"]
        and legacy["scored_0"] == 0 and legacy["scored_twice"] == 0
        and out.get("copy_training", {}).get("ok", True)
    )  # fmt: skip
    sys.exit(0 if ok else 1)


def user_sim(python: str) -> dict:
    """What running ``nemo_user_sim`` needs that is not here: its episode runtime is the
    ``usersim`` package of github.com/NVIDIA-NeMo/UserSim (a pinned git revision; PyPI has only
    a placeholder ``nemo-usersim`` 0.0.0a0), and its config asks for user, judge, summary and
    embedding model servers besides the assistant."""
    probe = subprocess.run([python, "-c", "import usersim.engine.external"],
                           capture_output=True, text=True)  # fmt: skip
    return {"runs": False, "import_usersim": probe.stderr.strip().splitlines()[-1:]}


if __name__ == "__main__":
    main()
