"""``streamrl bench vs-trl --task lookup``: streamrl against TRL's agent training
(``GRPOTrainer`` with ``environment_factory``) on the multi-turn tool task ``lookup`` with
SmolLM2-135M-Instruct, as whole processes from a cold start: one after the other, alternating
which goes first, or (``together``) both at once, so that the load other users put on a shared
machine falls on both sides alike.

streamrl runs the pipeline as a user would, each role its own process on a private Redis
(``streamrl up``, a rollout worker, a verifier, ``streamrl learn``, ``streamrl produce`` on
``configs/smollm2-lookup.toml``); TRL runs ``streamrl.benchmarks.trl_agent`` (matched to that
config: see its docstring). Both keep timestamped snapshots of their weights while they train
(streamrl: every policy version the learner publishes, dated when it appears; TRL: a save every
``--snapshot-every`` seconds, the time spent saving taken off its clock), and stop at their
time cap or once their training reward (mean of the last two steps) reaches ``stop_reward``.
Then, off the clock, each side's snapshots are evaluated in order with ``streamrl eval`` on
the same held-out prompts (``split=heldout``: names no training prompt has), the same way for
both, until one reaches the target; its time since the side's launch is the figure compared.

Two streamrl times for each snapshot: ``at``, when its version's directory appeared (the step,
then the learner's publish: the weights written and hashed, ~1 s for SmolLM2), and
``trained_at``, when the learner logged the step that made it (its ``step`` line, written
before the publish). TRL's time is its step's end with its save off the clock, so
``trained_at`` is the like-for-like figure (``ratio_trained``); ``ratio`` keeps the publish in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import redis

from streamrl.bus.keys import Keys
from streamrl.config import load_toml
from streamrl.local.procs import stop_all

RUN = "smollm2-lookup"
# what bench/smollm2_agent.py measures held-out success with (held-out episodes get more room
# than training's 36 tokens and 3 turns, so no gain comes from a budget the base model lacked)
EVAL_ARGS = ["--env-option", "split=heldout", "--max-turns", "4", "--max-new-tokens", "40",
             "--train-prompts", "1500"]  # fmt: skip


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "streamrl.cli", *argv]


def _scratch(config: Path, model: Path) -> tuple[Path, Path]:
    """A fresh directory with the model linked where the config looks for it and a copy of the
    config that keeps every policy version (they are the snapshots evaluated afterwards)."""
    work = Path(tempfile.mkdtemp(prefix="vs-trl-agent-"))
    (work / "models").mkdir()
    os.symlink(model.resolve(), work / "models" / model.name)
    text = re.sub(r"(?m)^keep_policy_versions = .*$", "keep_policy_versions = 1000",
                  config.read_text())  # fmt: skip
    # 8 rows per forward and backward on both sides: with 16, learner and TRL need ~8-10 GB each
    text = re.sub(r"(?m)^micro_batch_size = .*$", "micro_batch_size = 8", text)
    # every step's line in the learner's log: its time is the snapshot's ``trained_at``
    text = re.sub(r"(?m)^logging_steps = .*\n", "", text)
    text = re.sub(r"(?m)^\[learner\]\n", "[learner]\nlogging_steps = 1\n", text)
    cfg = work / config.name
    cfg.write_text(text)
    return work, cfg


def streamrl_side(
    config: Path, model: Path, seconds: float, stop_reward: float, rollout_workers: int = 1
) -> dict:
    """The pipeline, each role its own process; the policy versions and when each appeared."""
    work, cfg = _scratch(config, model)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("STREAMRL_REDIS_URL", None)
    procs: list[subprocess.Popen] = []
    (work / "logs").mkdir()

    def start(role: str, argv: list[str]) -> None:
        out = open(work / "logs" / f"{role}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen(
            argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append(p)

    launched = time.time()
    seen: dict[int, float] = {}
    rewards: dict[int, float] = {}
    policy_dir = work / ".streamrl" / RUN / "learner" / "policy"
    try:
        start("up", _cli("up"))
        url_file = work / ".streamrl" / "redis.url"
        while not url_file.exists():
            time.sleep(0.05)
        url = url_file.read_text().strip()
        env["RQ_REDIS_URL"] = url
        for i in range(rollout_workers):
            start(f"rollout{i or ''}", _cli("worker", "rollout"))
        start("verify", _cli("worker", "verify"))
        start("learn", _cli("learn", "--config", str(cfg)))
        start("produce", _cli("produce", "--config", str(cfg), "--count", "1500"))
        r = redis.Redis.from_url(url, decode_responses=True)
        key = Keys(RUN).learner
        next_read = 0.0
        while time.time() - launched < seconds:
            # versions looked for every 50 ms (TRL's side records its own save times), the
            # learner's rewards every 0.5 s
            time.sleep(0.05)
            for p in policy_dir.glob("v*"):  # a version directory appears whole (renamed)
                if p.name[1:].isdigit() and int(p.name[1:]) not in seen:
                    seen[int(p.name[1:])] = time.time()
            if time.time() < next_read:
                continue
            next_read = time.time() + 0.5
            h = r.hgetall(key)
            if h.get("reward_mean"):
                rewards[int(h["step"])] = float(h["reward_mean"])
            last = [rewards[s] for s in sorted(rewards)[-2:]]
            if len(last) == 2 and sum(last) / 2 >= stop_reward:
                break
        step = int(r.hget(key, "step") or 0)
    finally:
        stop_all(procs)  # a warm rq shutdown would wait out a 600 s lease
    every = int(load_toml(cfg).learner.get("sync_every", 1))
    trained = _step_times(work / "logs" / "learn.log")
    snaps = [{"version": v, "at": seen[v], "path": str(policy_dir / f"v{v}"),
              "trained_at": trained.get(v * every)}  # None: no step line for it
             for v in sorted(seen) if v > 0]  # fmt: skip
    return {"launched": launched, "work": str(work), "config": str(cfg), "snapshots": snaps,
            "steps": step, "stopped_after": round(time.time() - launched, 1),
            "rewards": [round(rewards[s], 4) for s in sorted(rewards)]}  # fmt: skip


def _step_times(log: Path) -> dict[int, float]:
    """When the learner logged each step (Unix time): its ``step`` lines in the JSON log."""
    out: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if '"event": "step"' not in line:
            continue
        try:
            rec = json.loads(line[line.index("{") :])
            stamp = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00"))
            out[int(rec["step"])] = stamp.timestamp()
        except (ValueError, KeyError, TypeError):
            continue
    return out


def trl_side(
    model: Path,
    config: Path,
    lr: float,
    seconds: float,
    stop_reward: float,
    every: float,
    threads: int = 2,
) -> dict:
    """``streamrl.benchmarks.trl_agent`` as its own process, stopped ``seconds`` after its
    launch if it has not stopped itself (it can only stop between steps); the snapshots it
    saved by then."""
    work, cfg = _scratch(config, model)
    bf16 = ["--bf16"] if load_toml(cfg).learner.get("autocast", "off") == "bfloat16" else []
    argv = [sys.executable, "-m", "streamrl.benchmarks.trl_agent", *bf16,
            "--model", str(work / "models" / model.name), "--snapshots", str(work / "snaps"),
            "--lr", str(lr), "--seconds", str(seconds), "--stop-reward", str(stop_reward),
            "--snapshot-every", str(every), "--threads", str(threads)]  # fmt: skip
    log = open(work / "trl.log", "wb")  # noqa: SIM115
    launched = time.time()
    proc = subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=log,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        stop_all([proc], grace_s=2.0)
        out = b""
    stopped = round(time.time() - launched, 1)
    lines = [ln for ln in out.decode().splitlines() if ln.startswith('{"lr"')]
    res: dict = json.loads(lines[-1]) if lines else {"lr": lr, "cut_off": True}
    if not lines and proc.returncode not in (0, None, -15, -9):
        tail = (work / "trl.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"trl_agent exited {proc.returncode}: {' | '.join(tail)}")
    index = work / "snaps" / "index.jsonl"
    res["snapshots"] = (
        [json.loads(ln) for ln in index.read_text().splitlines()] if index.exists() else []
    )
    steps = work / "snaps" / "steps.jsonl"
    if steps.exists() and "rewards" not in res:  # cut off before it printed its result
        logged = [json.loads(ln) for ln in steps.read_text().splitlines()]
        res["rewards"] = [round(s["reward"], 4) for s in logged]
        res["frac_reward_zero_std"] = [s["frac_reward_zero_std"] for s in logged]
        res["steps"] = logged[-1]["step"] if logged else 0
    res.setdefault("steps", res["snapshots"][-1]["step"] if res["snapshots"] else 0)
    res.setdefault("snapshot_seconds", None)
    res.update(launched=launched, work=str(work), config=str(cfg), stopped_after=stopped)
    return res


def held_out(config: str, weights: str, prompts: int, k: int) -> float:
    """pass@1 of ``weights`` on the held-out split, as ``streamrl eval`` measures it."""
    cwd = Path(config).parent
    argv = _cli("eval", "--config", config, "--prompts", str(prompts), "--k", str(k),
                "--weights", weights, "--json", *EVAL_ARGS)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["pass_at_1"])


def first_reaching(side: dict, target: float, prompts: int, k: int, say) -> dict:
    """Evaluate the snapshots in order until one reaches ``target``: its seconds since launch
    (and, for streamrl, since launch to the end of the step that made it: ``trained``)."""
    evals = []
    for snap in side["snapshots"]:
        p = held_out(side["config"], snap["path"], prompts, k)
        at = round(snap["at"] - side["launched"], 1)
        done = snap.get("trained_at", snap["at"])  # TRL's ``at`` is its step's end
        trained = round(done - side["launched"], 1) if done is not None else None
        evals.append({"at": at, "trained_at": trained, "pass_at_1": p,
                      **{k_: snap[k_] for k_ in ("version", "step") if k_ in snap}})  # fmt: skip
        say(f"    {Path(snap['path']).name} at {at} s (trained at {trained} s): held-out {p:.3f}")
        if p >= target:
            return {"seconds": at, "trained": trained, "evals": evals}
    return {"seconds": None, "trained": None, "evals": evals}


def vs_trl_agent(
    runs: int = 3,
    trl_lr: float = 1e-4,
    seconds: float = 480.0,
    trl_seconds: float | None = None,
    target: float = 0.5,
    config: str | None = None,
    model: str = "models/smollm2-135m",
    stop_reward: float = 0.8,
    eval_prompts: int = 50,
    eval_k: int = 4,
    snapshot_every: float = 60.0,
    together: bool = False,
    rollout_workers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict:
    say = progress or (lambda m: None)
    cfg = Path(config or "configs/smollm2-lookup.toml")
    mdl = Path(model)
    if not (mdl / "model.safetensors").is_file():
        raise FileNotFoundError(f"{model}: no model (python -m streamrl.models.gguf {model})")
    trl_cap = trl_seconds or seconds
    out: dict = {"task": "lookup", "target": target, "trl_lr": trl_lr, "seconds": seconds,
                 "trl_seconds": trl_cap, "eval": {"prompts": eval_prompts, "k": eval_k},
                 "config": str(cfg), "rollout_workers": rollout_workers,
                 "runs": []}  # fmt: skip

    def launch(name: str) -> dict:
        if name == "streamrl":
            side = streamrl_side(cfg, mdl, seconds, stop_reward, rollout_workers)
        else:
            side = trl_side(mdl, cfg, trl_lr, trl_cap, stop_reward, snapshot_every)
        say(f"  {name}: stopped after {side['stopped_after']} s, "
            f"{len(side['snapshots'])} snapshots, {side['steps']} steps")  # fmt: skip
        return side

    def judge(side: dict) -> dict:
        found = first_reaching(side, target, eval_prompts, eval_k, say)
        shutil.rmtree(side["work"], ignore_errors=True)
        return found

    pending = []
    evals = ThreadPoolExecutor(max_workers=2)
    for i in range(runs):
        order = ["streamrl", "trl"] if i % 2 == 0 else ["trl", "streamrl"]
        say(f"run {i + 1}/{runs}: {' and '.join(order) if together else ', then '.join(order)}")
        if together:  # both at once: the machine's other load falls on both alike
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {name: pool.submit(launch, name) for name in order}
                sides = {name: f.result() for name, f in futures.items()}
        else:
            sides = {name: launch(name) for name in order}
        pending.append((order, sides))
    # off the clock, after the runs: an evaluation holds gigabytes (64 episodes decoded at once)
    say("held-out success of the snapshots (off the clock) ...")
    found_all = [{name: evals.submit(judge, side) for name, side in sides.items()}
                 for _, sides in pending]  # fmt: skip
    for (order, sides), found in zip(pending, found_all, strict=True):
        row: dict = {"first": order[0], "together": together}
        for name, side in sides.items():
            res = found[name].result()
            row[name] = res["seconds"]
            row[f"{name}_trained"] = res["trained"]
            row[f"{name}_detail"] = {
                "stopped_after": side["stopped_after"], "steps": side["steps"],
                "rewards": side.get("rewards"), "evals": res["evals"],
                **({"lr": side["lr"], "snapshot_seconds": side["snapshot_seconds"],
                    "frac_reward_zero_std": side.get("frac_reward_zero_std")}
                   if name == "trl" else {}),
            }  # fmt: skip
            if row[name] is None:
                row[f"{name}_not_reached_in"] = side["stopped_after"]
        if row["streamrl"] and row["trl"]:
            row["ratio"] = round(row["streamrl"] / row["trl"], 3)
            if row["streamrl_trained"] and row["trl_trained"]:
                row["ratio_trained"] = round(row["streamrl_trained"] / row["trl_trained"], 3)
        say(
            f"  streamrl {row['streamrl']} s (trained {row['streamrl_trained']} s), trl "
            f"{row['trl']} s, ratio {row.get('ratio')} ({row.get('ratio_trained')} trained)"
        )
        out["runs"].append(row)
    evals.shutdown()
    ratios = [r["ratio"] for r in out["runs"] if "ratio" in r]
    for name in ("streamrl", "trl"):
        times = [r[name] for r in out["runs"] if r[name]]
        out[f"{name}_seconds_median"] = statistics.median(times) if times else None
        out[f"{name}_reached"] = f"{len(times)}/{runs}"
    out["ratio_median"] = statistics.median(ratios) if ratios else None
    trained = [r["ratio_trained"] for r in out["runs"] if "ratio_trained" in r]
    out["ratio_trained_median"] = statistics.median(trained) if trained else None
    return out
