"""streamrl against the PyPI ``nemo-gym`` releases, 0.4.0 and 0.7.0, each in its own
virtualenv (tests/support/nemo_gym_venv.py makes them: 0.7.0 declares Python >= 3.13.14 and runs
under 3.13.0 with ``--ignore-requires-python``): resources servers built on, or shipped in, the
release, driven by streamrl's ``nemo-gym`` environment, which finds each server's seed protocol
by itself.

    python bench/nemo_gym_pypi.py [--nemo-gym 0.7.0,0.4.0] [--prompts 8] [--train-steps 0]
                                  [--seconds 600]

Per release:

1. ``counter`` (bench/nemo_gym_pypi/servers.py, a ``SimpleResourcesServer``): ``--prompts`` x 4
   samples (scripted policy, real rq workers, private Redis); every sample scores 1.0 and the
   server shows one session per sample, seeded once (0.7: with the typed body, ``episode_id``
   attempt 0; 0.4: the row), every increment once, verified once, and (0.7) closed. The rows of
   ``streamrl export --format nemo-gym`` are validated by the release's own pydantic models and
   aggregated by the server's own ``/aggregate_metrics`` (stripped as its rollout collection
   strips them); 0.7.0 also runs ``gym eval aggregate`` on them, and 0.4.0's
   ``/aggregate_metrics`` takes the rows that 0.7.0's run exported.
2. ``shipped``: the release's own ``example_session_state_mgmt`` (a legacy seed with a required
   field: 0.7 answers the typed seed 422) and ``example_single_tool_call`` (0.7: typed seeds and
   ``/close_session``) with the rows of their own ``data/example.jsonl``.
3. ``tokens`` (0.7.0): exported rows whose turns carry token ids and log-probs validate as
   0.7's ``...ForTraining`` items; a partial set (which streamrl never writes) is refused.
   ``judge`` (0.7.0): a judged task whose judge is unreachable for some rows: the server's own
   ``judge_failsafe`` masks them (``reward 0.0``, ``mask_sample``, ``failure_kind:
   judge_failed``); streamrl dead-letters them by kind and scores the others with their
   ``reward_components``.
4. ``copy`` (``--train-steps`` > 0): ``streamrl demo``'s training (tiny Llama, hf backend) with
   every reward from the release's server.

Prints one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl import schema  # noqa: E402
from streamrl.config import PolicyConfig, RunConfig, VerifyConfig  # noqa: E402
from streamrl.local.pipeline import LocalPipeline, xrange_all  # noqa: E402
from streamrl.ops.export import ExportFilter, export_rows  # noqa: E402
from streamrl.ops.status import collect  # noqa: E402
from streamrl.producer.produce import Producer  # noqa: E402
from tests.support.nemo_gym import COUNTER_TOOLS, counter_row, free_port, write_rows  # noqa: E402
from tests.support.nemo_gym_venv import nemo_gym_python  # noqa: E402

SERVERS = Path(__file__).resolve().parent / "nemo_gym_pypi" / "servers.py"
SHIPPED = {  # server -> (module, class) in the wheel's resources_servers
    "example_session_state_mgmt": "StatefulCounterResourcesServer",
    "example_single_tool_call": "SimpleWeatherResourcesServer",
}

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


TOKENS = """
import json, sys
from nemo_gym.openai_utils import NeMoGymResponse
out = []
for line in open(sys.argv[1]):
    row = json.loads(line)
    try:
        items = NeMoGymResponse.model_validate(row["response"]).output
        out.append([type(i).__name__ for i in items])
    except Exception as e:
        out.append("refused: " + str(e).splitlines()[0][:200])
print(json.dumps(out))
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")[:500]


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
                _get(f"{self.url}/openapi.json")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{kind} server did not start; see {log}") from None
                time.sleep(0.5)

    def sessions(self) -> dict:
        return _get(f"{self.url}/_sessions")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def rollouts(url: str, rows: list[dict], tmp: Path, run: str, group: int = 4) -> dict:
    """The rows through a private pipeline against the server at ``url``: what was scored,
    dead-lettered and exported, and the run's status."""
    dataset = write_rows(tmp / f"{run}.jsonl", rows)
    cfg = RunConfig(
        run=run, env="nemo-gym", group_size=group, env_options={"base_url": url},
        policy=PolicyConfig(wrong_rate=0.0), verify=VerifyConfig(retries=1, timeout_s=60),
    )  # fmt: skip
    with LocalPipeline(cfg, directory=tmp / f"{run}-run") as p:
        p.start_workers(1, 1)
        Producer(p.r, cfg.run).from_jsonl(dataset, "nemo-gym", group)
        p.wait_groups(len(rows), timeout=300)
        it, _ = export_rows(p.r, cfg.run, "nemo-gym", ExportFilter())
        exported = write_rows(tmp / f"{run}-rollouts.jsonl", list(it))
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.dead)]
        states = [
            msgspec_state(s.trajectory.state)
            for _, f in xrange_all(p.r, p.keys.groups)
            for s in schema.GROUP.decode(f[b"p"]).samples
        ]
        status = collect(p.r, cfg.run)
    return {"exported": exported, "scores": scores, "dead": dead, "states": states,
            "status": status}  # fmt: skip


def msgspec_state(blob: bytes) -> dict:
    import msgspec

    return msgspec.msgpack.decode(blob) if blob else {}


def validated(python: str, exported: Path) -> tuple[int, str | None]:
    check = subprocess.run([python, "-c", VALIDATE, str(exported)], capture_output=True, text=True)
    if check.returncode != 0:
        return 0, check.stderr[-2000:]
    return int(check.stdout.strip() or 0), None


def aggregate_metrics(url: str, exported: Path) -> dict:
    """The exported rows through a server's own ``/aggregate_metrics``, stripped as NeMo Gym's
    rollout collection strips them (``response`` and ``responses_create_params`` out); and
    once more without the ``_ng_*`` keys, which NeMo Gym refuses."""
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
        "key_metrics": answer.get("key_metrics") if isinstance(answer, dict) else None,
        "without_ng_keys_status": without,
        "without_ng_keys_error": refusal if without != 200 else None,
    }


def gym_eval_aggregate(python: str, url: str, exported: Path, tmp: Path) -> dict:
    """NeMo Gym 0.7's own ``gym eval aggregate`` on the exported rows, its config (as a server
    it launches gets it, in ``NEMO_GYM_CONFIG_DICT``) naming the environment server the rows
    are stamped with, ``streamrl``, at the resources server's address."""
    out = tmp / "gym-aggregate" / "rollouts.jsonl"
    host, port = url.removeprefix("http://").split(":")
    config = {
        "input_glob": str(exported),
        "output_jsonl_fpath": str(out),
        "head_server": {"host": "127.0.0.1", "port": free_port()},
        "streamrl": {"environment_servers": {"streamrl": {"host": host, "port": int(port)}}},
    }
    gym = str(Path(python).parent / "gym")
    env = {**os.environ, "NEMO_GYM_CONFIG_DICT": json.dumps(config)}
    res = subprocess.run([gym, "eval", "aggregate"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp)  # fmt: skip
    metrics = out.with_name(out.stem + "_aggregate_metrics.json")
    if res.returncode != 0 or not metrics.exists():
        return {"returncode": res.returncode, "error": (res.stdout + res.stderr)[-3000:]}
    entries = json.loads(metrics.read_text())
    return {
        "returncode": res.returncode,
        "servers": [e.get("_ng_environment_server") for e in entries],
        "key_metrics": [e.get("key_metrics") for e in entries],
        "tasks": [len(e.get("group_level_metrics") or []) for e in entries],
        "merged_rows": sum(1 for _ in out.open()) if out.exists() else 0,
    }


def counter_rows(prompts: int) -> list[dict]:
    rng = random.Random(0)
    tools = [t for t in COUNTER_TOOLS if "counter" in t["name"]]
    rows = []
    for i in range(prompts):
        row = counter_row(f"c{i:05d}", rng.randint(0, 50), [rng.randint(1, 9) for _ in range(2)])
        row["responses_create_params"]["tools"] = tools
        rows.append(row)
    return rows


def counter_part(python: str, version: str, tmp: Path, prompts: int, extra: Path | None) -> dict:
    typed = version != "0.4.0"
    server = Server(python, "counter", tmp / "counter-server.log")
    try:
        got = rollouts(server.url, counter_rows(prompts), tmp, "pypi-counter")
        sessions = server.sessions()
        aggregate = aggregate_metrics(server.url, got["exported"])
        gym = gym_eval_aggregate(python, server.url, got["exported"], tmp) if typed else None
        other = aggregate_metrics(server.url, extra) if extra is not None else None
    finally:
        server.stop()
    exported = got["exported"]
    rewards = [json.loads(line)["reward"] for line in exported.read_text().splitlines()]
    n_valid, error = validated(python, exported)
    protocols = sorted({st.get("protocol") for st in got["states"]})
    # a 0.4 server reads the first typed seed of each worker process as a legacy one (no
    # echo): that empty session, never verified, cannot be closed there (no /close_session)
    probes = {k: s for k, s in sessions.items() if not s["verifies"]}
    sessions = {k: s for k, s in sessions.items() if s["verifies"]}
    episodes = [s["episode_id"] for s in sessions.values()]
    ok = (
        len(got["dead"]) == 0
        and rewards == [1.0] * (4 * prompts)
        and len(sessions) == 4 * prompts
        and all(s["seeds"] == 1 and len(s["calls"]) == 2 and s["verifies"] == 1
                for s in sessions.values())
        and all(s["closed"] == typed for s in sessions.values())
        and (not probes if typed else all(not s["calls"] for s in probes.values()))
        and protocols == (["typed"] if typed else ["legacy"])
        and all((e or {}).get("attempt") == 0 for e in episodes) == typed
        and n_valid == len(rewards)
        and aggregate["status"] == 200 and aggregate["tasks"] == prompts
        and aggregate["rollouts_per_task"] == [4]
        and aggregate["without_ng_keys_status"] == 500
        and (gym is None or (gym["returncode"] == 0 and gym["tasks"] == [prompts]))
        and (other is None or (other["status"] == 200 and other["tasks"] > 0))
    )  # fmt: skip
    return {
        "ok": ok,
        "samples": len(rewards),
        "dead_letters": len(got["dead"]),
        "mean_reward": sum(rewards) / max(1, len(rewards)),
        "seed_protocol": protocols,
        "server_sessions": len(sessions),
        "server_probe_sessions": len(probes),
        "server_sessions_closed": sum(1 for s in sessions.values() if s["closed"]),
        "server_seeds": sum(s["seeds"] for s in sessions.values()),
        "server_calls": sum(len(s["calls"]) for s in sessions.values()),
        "episode_attempts": sorted({(e or {}).get("attempt", -1) for e in episodes}),
        "rows_validated_by_nemo_gym_models": n_valid,
        "validation_error": error,
        "aggregate_metrics": aggregate,
        "gym_eval_aggregate": gym,
        "aggregate_metrics_of_other_release_rows": other,
    }


def _site(python: str, module: str) -> Path:
    out = subprocess.run([python, "-c", f"import {module} as m; print(m.__path__[0])"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def _message(text: str) -> dict:
    return {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _shipped_rows(python: str, name: str) -> list[dict]:
    """The server's own example rows, each with what a right agent does (``reference_output``,
    which streamrl's scripted policy replays and never sends)."""
    data = _site(python, f"resources_servers.{name}") / "data" / "example.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if name == "example_session_state_mgmt":
            add = row["expected_count"] - row.get("initial_count", 0)
            calls = [("increment_counter", {"count": add}), ("get_counter_value", {})]
            answer = str(row["expected_count"])
        else:
            calls, answer = [("get_weather", {"city": "San Francisco"})], "It is cold."
        out = []
        for j, (tool, args) in enumerate(calls):
            out.append({"type": "function_call", "call_id": f"c{j}", "name": tool,
                        "arguments": json.dumps(args)})  # fmt: skip
        row["reference_output"] = [*out, _message(answer)]
        row.setdefault("id", f"{name}-{i}")
    return rows


def shipped_part(python: str, tmp: Path) -> dict:
    out: dict = {}
    for name, cls in SHIPPED.items():
        kind = f"shipped:resources_servers.{name}.app:{cls}"
        server = Server(python, kind, tmp / f"{name}.log")
        try:
            rows = _shipped_rows(python, name)
            got = rollouts(server.url, rows, tmp, f"pypi-{name.replace('_', '-')}", group=2)
        finally:
            server.stop()
        rewards = [s.reward for s in got["scores"]]
        out[name] = {
            "ok": not got["dead"] and rewards == [1.0] * (2 * len(rows)),
            "rows": len(rows),
            "samples": len(rewards),
            "mean_reward": sum(r or 0 for r in rewards) / max(1, len(rewards)),
            "seed_protocol": sorted({st.get("protocol") for st in got["states"]}),
            "dead_letters": [d.reason[:300] for d in got["dead"]][:3],
        }
    return out


def tokens_part(python: str, tmp: Path) -> dict:
    """Rows whose turns carry token ids and log-probs (as the hf and openai backends record
    them), exported by streamrl, through 0.7's ``NeMoGymResponse``: the items that carry them
    must validate as its ``...ForTraining`` types; a row with one turn short of log-probs is
    exported without tokens, and the same row with the partial set written anyway is refused."""
    from streamrl.ops.export import _Indices, _nemo_gym_row

    prompt = [schema.Message(role="user", content="add 2")]
    call = schema.FunctionCall(call_id="c1", name="add", arguments='{"n": 2}')
    out = schema.FunctionCallOutput(call_id="c1", output="2")
    answer = schema.Message(role="assistant", content="2")

    def row(logprobs: list[float]) -> dict:
        turns = [
            schema.ModelTurn(index=0, items=[call], prompt_token_ids=[1, 2], token_ids=[3, 4],
                             logprobs=[-0.1, -0.2]),
            schema.ModelTurn(index=1, items=[answer], prompt_token_ids=[1, 2, 3, 4, 5],
                             token_ids=[6], logprobs=logprobs),
        ]  # fmt: skip
        traj = schema.Trajectory(
            task_id="p:0", prompt_id="p", k=0, group_size=1, env="nemo-gym",
            items=[*prompt, call, out, answer], n_input=1, turns=turns, status="completed",
        )  # fmt: skip
        score = schema.Score(task_id="p:0", prompt_id="p", k=0, reward=1.0)
        return _nemo_gym_row(schema.Sample(score=score, trajectory=traj), _Indices(), "streamrl")

    complete, short = row([-0.3]), row([])
    partial = json.loads(json.dumps(complete))
    del partial["response"]["output"][-1]["generation_log_probs"]
    path = write_rows(tmp / "tokens.jsonl", [complete, short, partial])
    res = subprocess.run([python, "-c", TOKENS, str(path)], capture_output=True, text=True)
    got = json.loads(res.stdout) if res.returncode == 0 else res.stderr[-2000:]
    ok = (
        isinstance(got, list)
        and got[0] == ["NeMoGymResponseFunctionToolCallForTraining", "NeMoGymFunctionCallOutput",
                       "NeMoGymResponseOutputMessageForTraining"]
        and not any("ForTraining" in t for t in got[1])
        and isinstance(got[2], str) and got[2].startswith("refused")
    )  # fmt: skip
    return {"ok": ok, "complete": got[0] if isinstance(got, list) else got,
            "without": got[1] if isinstance(got, list) else None,
            "partial_written_anyway": got[2] if isinstance(got, list) else None}  # fmt: skip


def judge_part(python: str, tmp: Path, prompts: int) -> dict:
    """Rows whose judge answers, and rows whose judge is a closed port."""
    server = Server(python, "judge", tmp / "judge.log")
    closed = f"127.0.0.1:{free_port()}"
    here = server.url.removeprefix("http://")
    rows = [
        {"id": f"j{i}", "responses_create_params": {"input": f"say {w}"}, "answer": w,
         "judge_url": closed if i % 2 else here, "reference_output": [_message(w)]}
        for i, w in enumerate(["yes", "no", "maybe", "sure"][: max(2, prompts)])
    ]  # fmt: skip
    try:
        got = rollouts(server.url, rows, tmp, "pypi-judge", group=2)
    finally:
        server.stop()
    masked = [d for d in got["dead"] if d.kind]
    scored = [s for s in got["scores"] if s.reward is not None]
    down = sum(1 for r in rows if r["judge_url"] == closed)
    ok = (
        len(masked) == len(got["dead"]) == 2 * down
        and {d.kind for d in masked} == {"masked:judge_failed"}
        and got["status"]["masked"] == {"judge_failed": 2 * down}
        and len(scored) == 2 * (len(rows) - down)
        and all(s.reward == 1.0 and s.info["reward_components"] == {"format": 1.0, "correct": 1.0}
                and s.components["reward_components.correct"] == 1.0 for s in scored)
        and not [s for s in got["scores"] if s.failure_kind and s.reward is not None]
    )  # fmt: skip
    return {
        "ok": ok,
        "rows": len(rows),
        "judge_down_rows": down,
        "masked_dead_letters": len(masked),
        "status_masked": got["status"]["masked"],
        "dead_letter_example": masked[0].reason[:300] if masked else None,
        "scored": len(scored),
        "reward_components": scored[0].info.get("reward_components") if scored else None,
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
    ap.add_argument("--nemo-gym", default="0.7.0,0.4.0", help="releases, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args()
    out: dict = {}
    exported_07: Path | None = None
    with tempfile.TemporaryDirectory(prefix="streamrl-nemo-gym-pypi-") as tmp:
        for version in args.nemo_gym.split(","):
            python = nemo_gym_python(version, say)
            part = Path(tmp) / version
            part.mkdir()
            got: dict = {"python": subprocess.run(
                [python, "-c", "import sys; print(sys.version.split()[0])"],
                capture_output=True, text=True, check=True).stdout.strip()}  # fmt: skip
            say(f"nemo-gym {version}: counter")
            extra = exported_07 if version == "0.4.0" else None
            got["counter"] = counter_part(python, version, part, args.prompts, extra)
            if version != "0.4.0":
                exported_07 = part / "pypi-counter-rollouts.jsonl"
            say(f"nemo-gym {version}: shipped servers")
            got["shipped"] = shipped_part(python, part)
            if version != "0.4.0":
                say(f"nemo-gym {version}: a judge that fails")
                got["judge"] = judge_part(python, part, 4)
                got["tokens"] = tokens_part(python, part)
            if args.train_steps > 0:
                say(f"nemo-gym {version}: training {args.train_steps} learner steps")
                got["copy_training"] = copy_part(python, part, args.train_steps, args.seconds)
            out[version] = got
            say(json.dumps(got, default=str)[:4000])
    print(json.dumps(out, indent=2, default=str))
    checks = [v for got in out.values() for v in got.values() if isinstance(v, dict)]
    checks += [v for got in out.values() for v in got.get("shipped", {}).values()]
    if not all(v.get("ok", True) for v in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
