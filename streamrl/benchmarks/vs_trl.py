"""``streamrl bench vs-trl``: streamrl against TRL's GRPOTrainer, as whole processes.

Each side is launched as its own process from a cold start (`streamrl demo --json` and
`python -m streamrl.benchmarks.trl_baseline`), one after the other, alternating which goes
first. Both
report the wall-clock moment they reached the target reward; the figure compared is that
moment minus the moment the process was launched, so interpreter start, imports, model
building, worker start-up and training all count, and tear-down does not. Same tiny model,
task (`copy`), reward rule (the copy verifier's positional match) and batch shape (8 prompts
x 8 samples per step); the target is a mean reward of 0.9 (streamrl: over the last 512 scored
samples; TRL: over its last 5 logged steps, 320 samples). Pair ``i`` runs both sides with seed
``first_seed + i`` (sampling, prompts, learner; the model's initial weights are the same in
every run): how many steps GRPO needs varies with the seed more than with anything else, so
one seed for every pair would measure that seed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _run(argv: list[str], timeout: float, env: dict[str, str]) -> dict:
    launched = time.time()
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path.cwd()
    )
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(argv[:4])} exited {done.returncode}: {' | '.join(tail)}")
    res = json.loads(lines[-1])
    reached = res.get("reached_at")
    res["whole_seconds_to_target"] = round(reached - launched, 2) if reached else None
    res["process_seconds"] = round(time.time() - launched, 2)
    return res


def vs_trl(
    runs: int = 3,
    trl_lr: float | None = None,
    seconds: float = 300.0,
    target: float = 0.9,
    config: str | None = None,
    progress: Callable[[str], None] | None = None,
    first_seed: int = 0,
) -> dict:
    say = progress or (lambda m: None)
    env = {**os.environ}
    env.pop("STREAMRL_REDIS_URL", None)  # the demo starts its own private Redis
    ours = [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seconds", str(seconds)]
    ours += ["--target", str(target)] + (["--config", config] if config else [])
    theirs = [sys.executable, "-m", "streamrl.benchmarks.trl_baseline", "--target", str(target)]
    theirs += ["--lr", str(trl_lr)] if trl_lr is not None else []
    out: dict = {"target": target, "runs": []}
    for i in range(runs):
        seed = ["--seed", str(first_seed + i)]
        order = [("streamrl", ours + seed), ("trl", theirs + seed)]
        if i % 2:
            order.reverse()
        row: dict = {"seed": first_seed + i}
        for name, argv in order:
            say(f"run {i + 1}/{runs} (seed {first_seed + i}): {name}")
            res = _run(argv, seconds + 300, env)
            row[name] = res["whole_seconds_to_target"]
            row[f"{name}_detail"] = {
                k: res.get(k)
                for k in (
                    "seconds_to_target", "startup_seconds", "training_seconds_to_target",
                    "steps_to_target", "learner_steps", "steps", "lr", "process_seconds",
                )
                if k in res
            }  # fmt: skip
            say(f"  {name}: {row[name]} s to {target}")
        if row["streamrl"] and row["trl"]:
            row["ratio"] = round(row["streamrl"] / row["trl"], 3)
        out["runs"].append(row)
    ratios = [r["ratio"] for r in out["runs"] if "ratio" in r]
    for name in ("streamrl", "trl"):
        times = [r[name] for r in out["runs"] if r[name]]
        out[f"{name}_seconds_median"] = statistics.median(times) if times else None
    out["ratio_median"] = statistics.median(ratios) if ratios else None
    return out
