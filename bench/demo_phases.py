"""Where a `streamrl demo` run spends its time, phase by phase: learner steps per second,
scored samples per step, reward, entropy and the whole machine's CPU use, in bins of a few
seconds, from the demo's own timeline (its JSON's ``timeline``) and ``/proc/stat``.

    python bench/demo_phases.py [--seed 2] [--bin 2] [--config FILE] [--json]

The demo runs as ``streamrl demo --json`` in a process of its own, as ``bench vs-trl`` runs
it. Samples per step above the batch (64) are groups dropped for zero variance: all wrong
early on, all right near the target. Linux only (``/proc/stat``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import subprocess
import sys
import threading
import time


def _cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample_cpu(out: list[tuple[float, int, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        out.append((time.time(), *_cpu()))
        stop.wait(0.25)


def _busy_between(cpu: list[tuple[float, int, int]], t0: float, t1: float) -> float | None:
    times = [c[0] for c in cpu]
    i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1) - 1
    if i >= j:
        return None
    (_, b0, a0), (_, b1, a1) = cpu[i][:3], cpu[j][:3]
    return (b1 - b0) / (a1 - a0) if a1 > a0 else None


def phases(result: dict, cpu: list[tuple[float, int, int]], width: float) -> list[dict]:
    """The demo's timeline cut into bins of ``width`` seconds."""
    rows, start, out = result["timeline"], result["started_at"], []
    prev = None
    for t, step, scored, reward, entropy, coef in rows:
        if prev is not None and t - prev[0] < width:
            continue
        if prev is not None and step > prev[1]:
            dt = t - prev[0]
            busy = _busy_between(cpu, start + prev[0], start + t)
            out.append(
                {
                    "seconds": round(t, 1),
                    "step": step,
                    "steps_per_s": round((step - prev[1]) / dt, 1),
                    "samples_per_step": round((scored - prev[2]) / (step - prev[1]), 1),
                    "reward": round(reward, 3),
                    "entropy": round(entropy, 3),
                    "entropy_coef": round(coef, 3),
                    "cpu_busy": None if busy is None else round(busy, 2),
                }
            )
        prev = (t, step, scored)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--bin", type=float, default=2.0, help="seconds per row")
    ap.add_argument("--config", default=None)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seed", str(args.seed)]
    argv += ["--seconds", str(args.seconds)] + (["--config", args.config] if args.config else [])
    cpu: list[tuple[float, int, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_cpu, args=(cpu, stop), daemon=True)
    sampler.start()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    stop.set()
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.exit(f"streamrl demo exited {done.returncode}: {done.stderr.strip()[-500:]}")
    result = json.loads(lines[-1])
    rows = phases(result, cpu, args.bin)
    keep = ("seconds_to_target", "steps_to_target", "startup_seconds", "samples_scored")
    summary = {k: result.get(k) for k in keep} | {"seed": args.seed, "phases": rows}
    if args.json:
        print(json.dumps(summary))
        return
    print({k: summary[k] for k in (*keep, "seed")})
    print(f"{'s':>6} {'step':>5} {'steps/s':>8} {'samples/step':>13} {'reward':>7} "
          f"{'entropy':>8} {'coef':>6} {'cpu':>5}")  # fmt: skip
    for r in rows:
        print(
            f"{r['seconds']:6.1f} {r['step']:5d} {r['steps_per_s']:8.1f} "
            f"{r['samples_per_step']:13.1f} {r['reward']:7.3f} {r['entropy']:8.3f} "
            f"{r['entropy_coef']:6.3f} {r['cpu_busy'] if r['cpu_busy'] is not None else '-':>5}"
        )


if __name__ == "__main__":
    main()
