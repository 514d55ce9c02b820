"""TRL's learning rate on ``lookup``: which rate reaches the held-out target in the fewest steps.

``streamrl bench vs-trl --task lookup`` compares streamrl with TRL "at its best learning rate";
this finds that rate. Each rate trains TRL (``streamrl.benchmarks.trl_agent``, the same process
``vs-trl`` runs) from the same seed, saving the weights after every optimizer step; then every
snapshot is scored on the held-out split exactly as ``vs-trl`` scores them. The steps are what
is compared (TRL's first generation batch is the same at every rate, so a rate changes only the
updates); rates run side by side (``--parallel``), so their wall times here are not figures. A
TRL process at 16 rows per step holds 5 to 10 GB: two at once fit 24 GB only with nothing else.

    python bench/trl_agent_lr.py --lrs 3e-5,1e-4,3e-4 --seconds 1000 --parallel 2 --threads 1 \
        [--eval-parallel 1] [--eval-prompts 40] [--eval-k 4] [--target 0.5] \
        [--out bench/results/trl_agent_lr.json]

Prints one JSON object: per rate, the training reward by step and the held-out pass@1 of each
step's snapshot; ``best_lr`` is the rate whose first snapshot at or above ``--target`` has the
fewest steps (ties: the higher held-out success).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamrl.benchmarks.vs_trl_agent import held_out, trl_side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", default="3e-5,1e-4,3e-4")
    ap.add_argument("--seconds", type=float, default=1000.0, help="training time cap per rate")
    ap.add_argument("--parallel", type=int, default=1, help="rates trained at once")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per TRL process")
    ap.add_argument("--eval-parallel", type=int, default=1, help="snapshots scored at once")
    ap.add_argument("--max-steps-evaluated", type=int, default=3)
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--config", default="configs/smollm2-lookup.toml")
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    lrs = [float(x) for x in a.lrs.split(",")]

    def train(lr: float) -> dict:
        side = trl_side(Path(a.model), Path(a.config), lr, a.seconds, 2.0, 0.0, a.threads)
        print(f"lr {lr:g}: {side['steps']} steps, rewards {side.get('rewards')}", file=sys.stderr)
        return side

    with ThreadPoolExecutor(a.parallel) as pool:
        sides = list(pool.map(train, lrs))
    jobs = [(i, s) for i, side in enumerate(sides) for s in side["snapshots"]
            if s["step"] <= a.max_steps_evaluated]  # fmt: skip

    def score(job: tuple[int, dict]) -> float | None:
        i, snap = job
        try:
            p = held_out(sides[i]["config"], snap["path"], a.eval_prompts, a.eval_k)
        except subprocess.CalledProcessError as e:  # e.g. killed for memory: say so, go on
            print(f"lr {lrs[i]:g} step {snap['step']}: evaluation failed: {e}", file=sys.stderr)
            return None
        print(f"lr {lrs[i]:g} step {snap['step']}: held-out {p:.3f}", file=sys.stderr)
        return p

    # an evaluation holds up to ~7 GB (64 episodes' caches and logits): one at a time by default
    with ThreadPoolExecutor(a.eval_parallel) as pool:
        scores = list(pool.map(score, jobs))
    out: dict = {"target": a.target, "eval": {"prompts": a.eval_prompts, "k": a.eval_k},
                 "rates": []}  # fmt: skip
    for i, (lr, side) in enumerate(zip(lrs, sides, strict=True)):
        held = {snap["step"]: p for (j, snap), p in zip(jobs, scores, strict=True) if j == i}
        reached = [s for s in sorted(held) if held[s] is not None and held[s] >= a.target]
        out["rates"].append({
            "lr": lr, "steps": side["steps"], "rewards": side.get("rewards"),
            "frac_reward_zero_std": side.get("frac_reward_zero_std"),
            "held_out_by_step": held, "first_step_at_target": reached[0] if reached else None,
        })  # fmt: skip
    ok = [r for r in out["rates"] if r["first_step_at_target"] is not None]
    best = min(ok, key=lambda r: (r["first_step_at_target"],
                                  -r["held_out_by_step"][r["first_step_at_target"]]),
               default=None)  # fmt: skip
    out["best_lr"] = best["lr"] if best else None
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
