"""Learner downtime: SIGKILL the learner several times in a live run and restart it with the same
command; measure how long it takes to train again, and check that the producer was held while
the learner was down (admission control) and that Redis stayed under its memory budget.

    python bench/learner_down.py [--steps 30] [--kills 3] [--down-s 5]
                                 [--learner-down-s 0] [--redis-memory-mb 1024]
                                 [--max-staleness N]

Everything runs on a private redis-server: one rq rollout worker (hf backend, the tiny Llama of
``streamrl.models.tiny``) and one rq verifier, ``streamrl produce --config ... --count N`` and
``streamrl learn --config ... --total-steps S`` as subprocesses, with the settings of
``configs/copy-tiny.toml`` (model paths pointed at a fresh tiny model, ``checkpoint_every``
from ``--checkpoint-every``). The learner is killed after evenly spaced steps, stays down for
``--down-s`` seconds, and is started again with the same command. ``--learner-down-s S`` adds
one long outage (S seconds, e.g. 600) before the last restart, sampling Redis ``used_memory``
every ``--sample-s`` seconds; with ``--max-staleness 1000 --redis-memory-mb 12`` the window
is wide and the memory budget is what holds the producer. ``--stale-lag N`` makes the rollout
workers serve the policy N versions behind the newest (hf option ``lag_versions``), the
incident where every group is dropped as stale: it runs for ``--seconds`` without kills, and
the producer must stop after a bounded amount of waste (``--max-drop-fraction 1`` restores
the old rule, for comparison).

Prints one JSON object. Per restart: ``restart_to_first_step_s`` (restart -> the restarted
learner's first optimizer step, i.e. the hash ``step`` past the checkpoint it restored),
``restart_to_recovered_s`` (-> past the step it was killed at), ``held`` (while the learner
was down, the producer's in-flight count as the gate computes it never exceeded the window),
``pushed_while_down`` and the producer's wait reason. Overall: the final step, whether it
reached ``--steps``, and the largest ``used_memory`` seen against the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl.bus.keys import Keys  # noqa: E402
from streamrl.config import RunConfig, load_toml  # noqa: E402
from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE  # noqa: E402
from streamrl.local.embedded import EmbeddedRedis  # noqa: E402
from streamrl.local.procs import WorkerProcs  # noqa: E402
from streamrl.producer import LearnerAdmission, admission_limit  # noqa: E402

RUN = "learner-down"
MiB = 2**20


def _val(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_val(x)}" for k, x in v.items()) + " }"
    return repr(v)


def write_config(path: Path, model: Path, out: Path, args) -> RunConfig:
    base = tomllib.loads((ROOT / "configs" / "copy-tiny.toml").read_text())
    policy = {**base["policy"], "model": str(model)}
    policy["options"] = {"max_batch": 256, "reload_check_s": 0.1}
    if args.stale_lag:
        policy["options"]["lag_versions"] = args.stale_lag
    learner = {**base["learner"], "model": str(model), "output_dir": str(out)}
    learner["checkpoint_every"] = args.checkpoint_every
    if args.max_staleness is not None:  # a wide window, so that the memory budget binds first
        learner["max_staleness"] = args.max_staleness
    lines = [f'run = "{RUN}"', f'env = "{base["env"]}"', f"group_size = {base['group_size']}"]
    tables = {
        "policy": policy,
        "admission": {
            "redis_memory_mb": float(args.redis_memory_mb),
            "max_drop_fraction": float(args.max_drop_fraction),
        },
        "learner": learner,
    }
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_val(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return load_toml(path)


class Run:
    def __init__(self, args, directory: Path):
        self.args = args
        self.dir = directory
        self.logs = directory / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.samples: list[tuple[float, int]] = []  # (t, used_memory)
        self.learner: subprocess.Popen | None = None
        self.starts = 0

    # ------------------------------------------------------------------ processes
    def cli(self, *argv: str, log: str) -> subprocess.Popen:
        out = open(self.logs / log, "ab")  # noqa: SIM115 - lives with the process
        cmd = [sys.executable, "-m", "streamrl.cli", "--redis", self.url, "--run", RUN, *argv]
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def start_learner(self) -> subprocess.Popen:
        self.starts += 1
        self.learner = self.cli(
            "learn",
            "--config",
            str(self.config_path),
            "--total-steps",
            str(self.args.steps),
            "--redis",  # `learn` takes these itself, not from the group options
            self.url,
            "--run",
            RUN,
            log=f"learner-{self.starts}.log",
        )
        return self.learner

    # ------------------------------------------------------------------ readings
    def learner_hash(self) -> dict[str, str]:
        raw = self.r.hgetall(self.keys.learner)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def step(self) -> int:
        return int(self.r.hget(self.keys.learner, "step") or 0)

    def sample_memory(self) -> int:
        used = int(self.r.info("memory")["used_memory"])
        self.samples.append((time.monotonic(), used))
        return used

    def tick(self, seconds: float) -> None:
        """Sleep, sampling memory every sample_s."""
        end = time.monotonic() + seconds
        while True:
            if not self.samples or time.monotonic() - self.samples[-1][0] >= self.args.sample_s:
                self.sample_memory()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def wait_step(self, cond, timeout: float, what: str) -> float:
        start = time.monotonic()
        while not cond():
            if self.learner is not None and self.learner.poll() not in (None, 0):
                raise RuntimeError(f"the learner exited ({self.learner.returncode}); see logs")
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{what}: not within {timeout} s; logs in {self.logs}")
            self.tick(0.05)
        return time.monotonic() - start

    def restored_step(self) -> int:
        ckpts = sorted((self.dir / "learner" / "checkpoints").glob("step-*"))
        ckpts = [p for p in ckpts if (p / "state.json").exists()]
        if not ckpts:
            return 0
        return int(json.loads((ckpts[-1] / "state.json").read_text())["step"])

    # ------------------------------------------------------------------ one outage
    def outage(self, down_s: float) -> dict:
        assert self.learner is not None
        killed_at_step = self.step()
        self.learner.send_signal(signal.SIGKILL)
        self.learner.wait()
        t_kill = time.monotonic()
        gate = self.gate.gate()
        pushed0 = gate.pushed
        max_in_flight, max_pushed, reasons = gate.in_flight, gate.pushed, set()
        mem0 = len(self.samples)
        while time.monotonic() - t_kill < down_s:
            self.tick(min(0.25, down_s))
            g = self.gate.gate()
            max_in_flight = max(max_in_flight, g.in_flight)
            max_pushed = max(max_pushed, g.pushed)
            reason = self.r.hget(self.keys.producer_state, "reason")
            if reason:
                reasons.add(reason.decode())
        down_mem = [u for _, u in self.samples[mem0:]]
        restored = self.restored_step()
        t0 = time.monotonic()
        proc = self.start_learner()
        pid = str(proc.pid)

        def trained() -> bool:
            h = self.learner_hash()
            return h.get("pid") == pid and int(h.get("step", 0)) > restored

        first = self.wait_step(trained, self.args.timeout_s, "a step after the restart")
        recovered = self.wait_step(
            lambda: self.step() > killed_at_step or self.step() >= self.args.steps,
            self.args.timeout_s,
            "back past the step it was killed at",
        )
        return {
            "killed_at_step": killed_at_step,
            "restored_step": restored,
            "down_s": round(t0 - t_kill, 2),
            "restart_to_first_step_s": round(first, 2),
            "restart_to_recovered_s": round(time.monotonic() - t0, 2) if recovered else 0.0,
            "window": gate.limit,
            "in_flight_at_kill": gate.in_flight,
            "max_in_flight_while_down": max_in_flight,
            "pushed_while_down": max_pushed - pushed0,
            "held": gate.limit is not None and max_in_flight <= gate.limit,
            "producer_wait_reasons": sorted(reasons),
            "max_used_memory_mb_while_down": round(max(down_mem, default=0) / MiB, 2),
        }

    # ------------------------------------------------------------------ the run
    def __call__(self) -> dict:
        a = self.args
        from streamrl.models.tiny import save_tiny

        model = save_tiny(self.dir / "model")
        self.config_path = self.dir / "run.toml"
        cfg = write_config(self.config_path, model, self.dir / "learner", a)
        window = admission_limit(cfg.learner, cfg.group_size)
        self.learner_cfg = cfg.learner
        with EmbeddedRedis(self.dir / "redis") as server:
            self.url = server.url
            self.r = redis.Redis.from_url(self.url)
            self.keys = Keys(RUN)
            self.gate = LearnerAdmission.from_config(self.r, cfg, window)
            procs = WorkerProcs(self.url, log_dir=self.logs, env=self.env)
            producer = None
            started = time.monotonic()
            try:
                procs.start(ROLLOUT_QUEUE, 1)
                procs.start(VERIFY_QUEUE, 1)
                producer = self.cli(
                    "produce", "--config", str(self.config_path), "--count", str(a.count),
                    log="producer.log",
                )  # fmt: skip
                self.start_learner()
                if a.stale_lag:
                    return self.stale_run(window, producer, procs, started)
                kill_steps = [
                    round(a.steps * (i + 1) / (a.kills + 1)) for i in range(a.kills)
                ]  # evenly spaced, before the target
                restarts = []
                for i, at in enumerate(kill_steps):
                    self.wait_step(lambda at=at: self.step() >= at, a.timeout_s, f"step {at}")
                    last = i == len(kill_steps) - 1
                    down = a.learner_down_s if last and a.learner_down_s else a.down_s
                    restarts.append(self.outage(down))
                self.wait_step(lambda: self.step() >= a.steps, a.timeout_s * 4, f"step {a.steps}")
                assert self.learner is not None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.learner.wait(timeout=60)
                final = self.learner_hash()
                state = {
                    k.decode(): v.decode()
                    for k, v in self.r.hgetall(self.keys.producer_state).items()
                }
                pushed = self.gate.gate().pushed
            finally:
                if producer is not None and producer.poll() is None:
                    producer.send_signal(signal.SIGINT)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        producer.wait(timeout=10)
                    if producer.poll() is None:
                        producer.kill()
                if self.learner is not None and self.learner.poll() is None:
                    self.learner.kill()
                self.r.set(self.keys.halt, 1)
                procs.stop(timeout=15)
            waits = (
                (self.logs / "producer.log").read_text(errors="replace").count("producer waiting (")
            )
            budget = self.gate.memory(self.gate.gate(), fresh=True)
            used = [u for _, u in self.samples]
            return {
                "steps_target": a.steps,
                "final_step": int(final.get("step", 0)),
                "reached_target": int(final.get("step", 0)) >= a.steps,
                "learner_exit": self.learner.returncode if self.learner else None,
                "learner_status": final.get("status"),
                "groups_applied": int(final.get("groups_applied", 0)),
                "dropped_stale": int(final.get("dropped_stale", 0)),
                "dropped_zero_variance": int(final.get("dropped_zero_variance", 0)),
                "window_samples": window,
                "tasks_pushed": pushed,
                "restarts": restarts,
                "all_held": all(x["held"] for x in restarts),
                "producer_state": {k: state.get(k) for k in ("state", "reason", "debt", "probes")},
                "producer_wait_messages": waits,
                "memory_budget_mb": round(budget.budget / MiB, 1) if budget else None,
                "max_used_memory_mb": round(max(used, default=0) / MiB, 2),
                "memory_samples": len(used),
                "seconds": round(time.monotonic() - started, 1),
                "logs": str(self.logs) if a.keep else None,
            }

    def stale_run(self, window, producer, procs, started) -> dict:
        """Workers serve an old policy: every group past the first few steps is stale. Run
        for --seconds and report how much the producer pushed and why it waits."""
        a = self.args
        trace = []  # (t, pushed, applied groups, dropped stale groups)
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.seconds:
            self.tick(1.0)
            h = self.learner_hash()
            g = self.gate.gate()
            trace.append(
                (
                    round(time.monotonic() - t0, 1),
                    g.pushed,
                    int(h.get("groups_applied", 0)),
                    int(h.get("dropped_stale", 0)),
                )
            )
        h = self.learner_hash()
        st = {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.producer_state).items()}
        ratio = self.gate.ratio or 0.0
        useful = int(st.get("useful", 0) or 0)
        # pushed <= useful + settled drops + one window in flight, and settled drops <= one
        # window (the start allowance) + ratio x useful; plus one learner batch per probe
        bound = useful + window + ratio * useful + window
        probes = int(st.get("probes", 0) or 0)
        batch = window // (int(self.learner_cfg.get("max_staleness", 4)) + 1)
        pushed = trace[-1][1] if trace else 0
        stalled = next((t for t, _, applied, _ in trace if applied == trace[-1][2]), None)
        return {
            "scenario": f"stale policy (lag_versions {a.stale_lag})",
            "seconds": round(time.monotonic() - started, 1),
            "final_step": int(h.get("step", 0)),
            "groups_applied": int(h.get("groups_applied", 0)),
            "dropped_stale": int(h.get("dropped_stale", 0)),
            "dropped_zero_variance": int(h.get("dropped_zero_variance", 0)),
            "window_samples": window,
            "tasks_pushed": pushed,
            "pushed_bound": int(bound + probes * batch) if self.gate.ratio is not None else None,
            "within_bound": pushed <= bound + probes * batch
            if self.gate.ratio is not None
            else None,
            "training_stalled_at_s": stalled,
            "pushed_last_half": pushed - trace[len(trace) // 2][1] if trace else 0,
            "producer_state": {
                k: st.get(k) for k in ("state", "reason", "debt", "probes", "message")
            },
            "max_used_memory_mb": round(max(u for _, u in self.samples) / MiB, 2),
            "trace_every_10s": trace[::10],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="learner steps to reach")
    ap.add_argument("--kills", type=int, default=3, help="learner SIGKILLs")
    ap.add_argument("--down-s", type=float, default=5.0, help="seconds down per kill")
    ap.add_argument(
        "--learner-down-s", type=float, default=0.0, help="the last outage lasts this long"
    )
    ap.add_argument("--sample-s", type=float, default=2.0, help="used_memory sampling period")
    ap.add_argument("--redis-memory-mb", type=float, default=1024.0)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument(
        "--max-staleness", type=int, default=None, help="override the config's (window size)"
    )
    ap.add_argument(
        "--max-drop-fraction", type=float, default=0.9, help="1.0: every drop settles (old rule)"
    )
    ap.add_argument("--count", type=int, default=10**6, help="prompts the producer may push")
    ap.add_argument("--stale-lag", type=int, default=0, help="rollouts serve N versions back")
    ap.add_argument("--seconds", type=float, default=120.0, help="--stale-lag run length")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--dir", default=None, help="keep everything here (default: a temp dir)")
    args = ap.parse_args()
    args.keep = args.dir is not None
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        out = Run(args, Path(args.dir))()
    else:
        with tempfile.TemporaryDirectory(prefix="streamrl-learner-down-") as d:
            out = Run(args, Path(d))()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
