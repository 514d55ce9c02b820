"""The demo with its workers at a lower CPU priority than the learner, against all at one:
time to learner steps 50, 200, 350 and 500 and to the reward target, per seed, the two
settings interleaved seed by seed (the machine's speed drifts over minutes).

    python bench/learner_first.py --seeds 26-33 [--nice 0,19] [--threads] [--json]

Each run is ``streamrl demo --json --seed S --worker-nice N`` in a process of its own.
Steps to the target vary from run to run far more than a few per cent (430-800 on one
config), so the time to a fixed step, before the reward nears the target, is the steadier
measure of how fast the pipeline goes. ``--threads`` also samples the state of every thread
of the demo's process tree every ~2 ms (Linux ``/proc``) and reports, between the first
learner step and the target, how often the learner was runnable (running or waiting for a
CPU) and how often it was the only runnable thread (the other core idle); the sampler costs
some CPU itself, so its runs are slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter

from streamrl.local.procs import descendants, role_of

STEPS = (50, 200, 350, 500)


def seconds_at(timeline: list[list[float]], steps: tuple[int, ...] = STEPS) -> dict:
    """Seconds (from the demo's start) at which the learner had taken each of ``steps``."""
    return {s: next((round(t, 2) for t, step, *_ in timeline if step >= s), None) for s in steps}


def _runnable(pids: list[int]) -> list[str]:
    """The roles of the threads of ``pids`` in state R (running or waiting for a CPU)."""
    roles = []
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
            with open(f"/proc/{pid}/cmdline") as f:
                role = role_of(f.read().replace("\0", " "))
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2] == "R":
                roles.append(role)
    return roles


def _sample_threads(root: int, out: list, stop: threading.Event) -> None:
    pids, listed = [], 0.0
    while not stop.is_set():
        now = time.time()
        if now - listed > 0.5:  # processes start and end rarely; threads are read each time
            pids, listed = [root, *descendants(root)], now
        out.append((now, _runnable(pids)))
        time.sleep(0.002)


def thread_shares(samples: list, t0: float, t1: float) -> dict:
    """Of the samples between ``t0`` and ``t1``: how often the learner was runnable, and how
    often one thread or none was (a core idle) and, of those, the learner alone."""
    window = [roles for t, roles in samples if t0 <= t <= t1]
    if not window:
        return {}
    n, count = len(window), Counter()
    for roles in window:
        count["learner_runnable"] += "learner" in roles
        count["at_most_one_runnable"] += len(roles) <= 1
        count["learner_alone"] += roles == ["learner"]
    return {"samples": n, **{k: round(v / n, 3) for k, v in count.items()}}


def run(seed: int, nice: int, threads: bool, seconds: float) -> dict:
    argv = [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seed", str(seed)]
    argv += ["--worker-nice", str(nice), "--seconds", str(seconds)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list = []
    stop = threading.Event()
    if threads:
        sampler = threading.Thread(target=_sample_threads, args=(proc.pid, samples, stop))
        sampler.start()
    out, err = proc.communicate()
    stop.set()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"streamrl demo exited {proc.returncode}: {err.strip()[-500:]}")
    res = json.loads(lines[-1])
    row = {
        "seed": seed,
        "worker_nice": nice,
        "seconds_to_target": res["seconds_to_target"],
        "steps_to_target": res["steps_to_target"],
        "startup_seconds": res["startup_seconds"],
        "seconds_at_step": seconds_at(res["timeline"]),
        "cpu_seconds": res["cpu_seconds"],
    }
    if threads and res["reached_at"] and res["startup_seconds"] is not None:
        first_step = res["started_at"] + res["startup_seconds"]
        row["threads"] = thread_shares(samples, first_step, res["reached_at"])
    return row


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="26-33", help="a range (26-33) or a list (1,4,7)")
    ap.add_argument("--nice", default="0,19", help="the worker nice values to compare")
    ap.add_argument("--threads", action="store_true", help="sample thread states (Linux)")
    ap.add_argument("--seconds", type=float, default=120.0, help="each run's time limit")
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    args = ap.parse_args()
    settings = [int(n) for n in args.nice.split(",")]
    for i, seed in enumerate(_seeds(args.seeds)):
        for nice in settings if i % 2 == 0 else settings[::-1]:  # each goes first in turn
            row = run(seed, nice, args.threads, args.seconds)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            at = " ".join(f"{s}:{t}" for s, t in row["seconds_at_step"].items())
            extra = f" threads {row['threads']}" if "threads" in row else ""
            print(
                f"seed {seed} nice {nice}: to target {row['seconds_to_target']} s, "
                f"{row['steps_to_target']} steps; s at step {at}{extra}",
                flush=True,
            )


if __name__ == "__main__":
    main()
