"""Trajectories per second through a NeMo Gym resources server, next to the scripted-policy
figure of the in-process ``counter`` environment with the same number of turns.

    python bench/nemo_gym_throughput.py [--prompts 500] [--group-size 4]
                                        [--concurrency 64 256] [--adds 2]
                                        [--verify-workers 1]

Starts the test suite's resources server (tests/support/nemo_gym_server.py: FastAPI,
SessionMiddleware, a stateful counter; one uvicorn process) on a free port, writes NeMo Gym
rows whose episodes take ``adds + 1`` model turns (one ``increment_counter`` call per turn,
then the answer), and runs ``streamrl bench nemo-gym`` at each concurrency (one rollout
worker, one verifier worker, scripted policy: every seed, tool call and verify is a real HTTP
request). The baseline is ``streamrl bench pipeline --turns adds+1`` with the same prompts,
group size and concurrency. The server's CPU is not in ``cpu_seconds`` (another process
tree); its cost is in the wall time. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl.benchmarks.pipeline import nemo_gym_bench, pipeline_bench  # noqa: E402
from tests.support.nemo_gym import counter_row, resources_server, write_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--adds", type=int, default=2, help="tool calls per episode")
    ap.add_argument("--verify-workers", type=int, default=1)
    args = ap.parse_args()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rng = random.Random(0)
    out: dict = {"prompts": args.prompts, "group_size": args.group_size, "turns": args.adds + 1}
    with tempfile.TemporaryDirectory(prefix="streamrl-nemo-bench-") as tmp:
        rows = [
            counter_row(
                f"p{i:06d}", rng.randint(0, 99), [rng.randint(1, 9) for _ in range(args.adds)]
            )
            for i in range(args.prompts)
        ]
        dataset = write_rows(Path(tmp) / "rows.jsonl", rows)
        with resources_server(Path(tmp) / "server") as url:
            for c in args.concurrency:
                say(f"nemo-gym, concurrency {c}")
                res = nemo_gym_bench(
                    url, str(dataset), args.group_size, c,
                    verify_workers=args.verify_workers, progress=say,
                )  # fmt: skip
                out[f"nemo_gym_c{c}"] = res
                say(json.dumps(res))
        for c in args.concurrency:
            say(f"scripted counter baseline, concurrency {c}")
            res = pipeline_bench(
                tasks=args.prompts, group_size=args.group_size, turns=args.adds + 1,
                max_concurrent=c, verify_workers=args.verify_workers, progress=say,
            )  # fmt: skip
            out[f"scripted_counter_c{c}"] = res
            say(json.dumps(res))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
