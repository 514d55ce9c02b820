"""streamrl against the PyPI ``nemo-gym`` package: resources servers that subclass its
``SimpleResourcesServer`` (bench/nemo_gym_pypi/servers.py), run under their own Python >= 3.12
(nemo-gym requires it, and brings Ray), driven by streamrl's ``nemo-gym`` environment.

    python bench/nemo_gym_pypi.py [--nemo-gym-python PATH] [--prompts 40]
                                  [--train-steps 30] [--seconds 600]

Python for nemo-gym: ``--nemo-gym-python``, else ``$STREAMRL_NEMO_GYM_PYTHON``, else
``.venv-nemo-gym/bin/python``, which is created (``python3.12 -m venv`` with the first
Python >= 3.12 found on PATH or under pyenv, then ``pip install nemo-gym``) when missing.

1. ``counter``: rollouts of ``--prompts`` x 4 samples through the stateful counter (scripted
   policy, real rq workers, private Redis): every sample must score 1.0 and the server must show
   one session per sample, seeded once, with every increment exactly once. The rollouts are then
   exported as NeMo Gym rows and each row's ``responses_create_params`` and ``response`` are
   validated with nemo-gym's own pydantic models (``NeMoGymResponseCreateParamsNonStreaming``,
   ``NeMoGymResponse``) in the nemo-gym Python, and aggregated by the server's own
   ``/aggregate_metrics`` (stripped as NeMo Gym's rollout collection strips them): one group of
   4 rollouts per prompt; the same rows without ``_ng_task_index``/``_ng_rollout_index`` must
   be refused, as NeMo Gym refuses rows that lack them. ``--train-steps 0`` stops here.
2. ``copy``: ``streamrl demo``'s training (tiny Llama, hf backend, GRPO learner,
   configs/copy-tiny.toml) with ``env = "nemo-gym"``: prompts cycle a NeMo Gym dataset of copy
   rows and every reward comes from the PyPI server's ``/verify``; ``--train-steps`` learner
   steps.

Prints one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl.config import PolicyConfig, RunConfig  # noqa: E402
from streamrl.local.pipeline import LocalPipeline  # noqa: E402
from streamrl.ops.export import ExportFilter, export_rows  # noqa: E402
from streamrl.producer.produce import Producer  # noqa: E402
from tests.support.nemo_gym import COUNTER_TOOLS, counter_row, free_port, write_rows  # noqa: E402

SERVERS = Path(__file__).resolve().parent / "nemo_gym_pypi" / "servers.py"
VENV = ROOT / ".venv-nemo-gym"

VALIDATE = """
import json, sys
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
n = 0
for line in open(sys.argv[1]):
    row = json.loads(line)
    NeMoGymResponseCreateParamsNonStreaming.model_validate(row["responses_create_params"])
    NeMoGymResponse.model_validate(row["response"])
    n += 1
print(n)
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_python312() -> str | None:
    for name in ("python3.12", "python3.13", "python3.14"):
        path = shutil.which(name)
        if path and subprocess.run([path, "-V"], capture_output=True).returncode == 0:
            return path
    pyenv = os.path.expanduser("~/.pyenv/versions")
    for pattern in ("3.12*", "3.13*", "3.14*"):
        for d in sorted(glob.glob(os.path.join(pyenv, pattern))):
            if os.path.exists(f"{d}/bin/python"):
                return f"{d}/bin/python"
    return None


def nemo_gym_python(given: str | None) -> str:
    given = given or os.environ.get("STREAMRL_NEMO_GYM_PYTHON")
    if given:
        return given
    py = VENV / "bin" / "python"
    if not py.exists():
        base = find_python312()
        if base is None:
            sys.exit("nemo-gym needs Python >= 3.12 and none was found: install one (pyenv, apt) "
                     "or pass --nemo-gym-python")  # fmt: skip
        say(f"creating {VENV} with {base} and installing nemo-gym from PyPI (takes minutes)")
        subprocess.run([base, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "nemo-gym"], check=True)
    return str(py)


class Server:
    def __init__(self, python: str, kind: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, str(SERVERS), "--kind", kind, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180  # importing nemo_gym (Ray, mlflow...) is slow
        while True:
            try:
                self.sessions()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{kind} server did not start; see {log}") from None
                time.sleep(0.5)

    def sessions(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/_sessions", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def counter_part(python: str, tmp: Path, prompts: int) -> dict:
    rng = random.Random(0)
    tools = [t for t in COUNTER_TOOLS if "counter" in t["name"]]
    rows = []
    for i in range(prompts):
        row = counter_row(f"c{i:05d}", rng.randint(0, 50), [rng.randint(1, 9) for _ in range(2)])
        row["responses_create_params"]["tools"] = tools
        rows.append(row)
    dataset = write_rows(tmp / "counter.jsonl", rows)
    server = Server(python, "counter", tmp / "counter-server.log")
    try:
        cfg = RunConfig(
            run="pypi-counter",
            env="nemo-gym",
            group_size=4,
            env_options={"base_url": server.url},
            policy=PolicyConfig(wrong_rate=0.0),
        )
        with LocalPipeline(cfg, directory=tmp / "counter-run") as p:
            p.start_workers(1, 1)
            Producer(p.r, cfg.run).from_jsonl(dataset, "nemo-gym", 4)
            p.wait_groups(prompts, timeout=300)
            it, _ = export_rows(p.r, cfg.run, "nemo-gym", ExportFilter())
            exported = write_rows(tmp / "counter-rollouts.jsonl", list(it))
            completed, dead = p.stat("groups_completed"), p.r.xlen(p.keys.dead)
        sessions = server.sessions()
        aggregate = aggregate_metrics(server.url, exported)
    finally:
        server.stop()
    rewards = [json.loads(line)["reward"] for line in exported.read_text().splitlines()]
    check = subprocess.run([python, "-c", VALIDATE, str(exported)], capture_output=True, text=True)
    validated = int(check.stdout.strip() or 0) if check.returncode == 0 else 0
    ok = (
        completed == prompts
        and dead == 0
        and rewards == [1.0] * (4 * prompts)
        and len(sessions) == 4 * prompts
        and all(s["seeds"] == 1 and len(s["calls"]) == 2 for s in sessions.values())
        and validated == len(rewards)
        and aggregate["status"] == 200
        and aggregate["tasks"] == prompts
        and aggregate["rollouts_per_task"] == [4]
        and aggregate["without_ng_keys_status"] == 500
    )
    return {
        "ok": ok,
        "groups_completed": completed,
        "dead_letters": dead,
        "samples": len(rewards),
        "mean_reward": sum(rewards) / max(1, len(rewards)),
        "server_sessions": len(sessions),
        "rows_validated_by_nemo_gym_models": validated,
        "validation_error": None if check.returncode == 0 else check.stderr[-2000:],
        "aggregate_metrics": aggregate,
    }


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")[:500]


def aggregate_metrics(url: str, exported: Path) -> dict:
    """The exported rows through the server's own ``/aggregate_metrics``, stripped as NeMo
    Gym's rollout collection strips them (``response`` and ``responses_create_params`` out);
    and once more without the ``_ng_*`` keys, which NeMo Gym refuses (as it refused streamrl's
    rows before they carried them)."""
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    heavy = ("response", "responses_create_params")
    stripped = [{k: v for k, v in r.items() if k not in heavy} for r in rows]
    status, answer = _post(f"{url}/aggregate_metrics", {"verify_responses": stripped})
    bare = [{k: v for k, v in r.items() if not k.startswith("_ng_")} for r in stripped]
    without, refusal = _post(f"{url}/aggregate_metrics", {"verify_responses": bare})
    groups = answer.get("group_level_metrics", []) if isinstance(answer, dict) else []
    agent = answer.get("agent_metrics", {}) if isinstance(answer, dict) else {}
    return {
        "status": status,
        "error": None if status == 200 else answer,
        "tasks": len(groups),
        "rollouts_per_task": sorted({g.get("num_rollouts") for g in groups}),
        "mean_reward": agent.get("mean/reward"),
        "without_ng_keys_status": without,
        "without_ng_keys_error": refusal if without != 200 else None,
    }


def copy_part(python: str, tmp: Path, steps: int, seconds: float) -> dict:
    from streamrl.local.demo import DEMO_CONFIG, DemoOptions, train_demo

    rng = random.Random(1)
    symbols = [chr(ord("a") + i) for i in range(16)]
    rows = []
    for i in range(512):
        answer = [rng.choice(symbols) for _ in range(3)]
        rows.append(
            {
                "id": f"copy{i:05d}",
                "responses_create_params": {"input": "copy : " + " ".join(answer)},
                "answer": answer,
            }
        )
    dataset = write_rows(tmp / "copy.jsonl", rows)
    server = Server(python, "copy", tmp / "copy-server.log")
    try:
        text = Path(DEMO_CONFIG).read_text().replace('env = "copy"', 'env = "nemo-gym"')
        text += f'\n[env_options]\nbase_url = "{server.url}"\nrows = "{dataset}"\n'
        config = tmp / "copy-nemo-gym.toml"
        config.write_text(text)
        opts = DemoOptions(
            seconds=seconds, target=None, live=False, config=config, max_steps=steps,
            directory=tmp / "copy-run",
        )  # fmt: skip
        res = train_demo(opts)
        verifies = server.sessions()["verified"]
    finally:
        server.stop()
    keep = ("reward_first", "reward_last", "learner_steps", "seconds", "groups_trained")
    out = {k: res.get(k) for k in keep}
    out["server_verifies"] = verifies  # every reward came from the nemo-gym server's /verify
    out["ok"] = (res.get("learner_steps") or 0) >= steps and verifies > 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo-gym-python", default=None)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args()
    python = nemo_gym_python(args.nemo_gym_python)
    version = subprocess.run(
        [python, "-c", "import importlib.metadata as m, sys; "
         "print(m.version('nemo-gym'), sys.version.split()[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    out: dict = {"nemo_gym": version[0], "python": version[1]}
    with tempfile.TemporaryDirectory(prefix="streamrl-nemo-gym-pypi-") as tmp:
        say("counter: rollouts through nemo-gym's SimpleResourcesServer")
        out["counter"] = counter_part(python, Path(tmp), args.prompts)
        say(json.dumps(out["counter"]))
        if args.train_steps > 0:
            say(f"copy: training {args.train_steps} learner steps through nemo-gym's server")
            out["copy_training"] = copy_part(python, Path(tmp), args.train_steps, args.seconds)
    print(json.dumps(out, indent=2))
    if not all(v.get("ok") for v in out.values() if isinstance(v, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
