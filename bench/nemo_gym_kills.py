"""Rollout workers killed inside the windows that matter, against a stateful NeMo Gym-style
resources server (tests/support/nemo_gym_server.py, its own process): how many tool calls the
server applied twice, how many sessions were left open, how many samples were scored 0 or
dropped. Real rq workers, a private Redis; the work horse SIGKILLs itself at the fault points
of ``streamrl.envs._failpoints`` (figures and their meaning: tests/support/nemo_gym_kills.py).

    python bench/nemo_gym_kills.py [--prompts 40] [--faults after_open:1,after_tool_send:3]
                                   [--p 1.0] [--seed 0] [--rollout-workers 1]
                                   [--protocol typed|legacy|mixed]

Prints one JSON object per run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamrl.local.embedded import EmbeddedRedis  # noqa: E402
from tests.support.nemo_gym import resources_server  # noqa: E402
from tests.support.nemo_gym_kills import kill_run  # noqa: E402
from tests.support.nemo_gym_server import PROTOCOLS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--faults", default="after_open:1,after_tool_send:3")
    ap.add_argument("--p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollout-workers", type=int, default=1)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="typed",
                    help="the server's seeds: typed (NeMo Gym 0.7), legacy (0.4: no "
                    "/close_session) or mixed (legacy seeds, /close_session)")  # fmt: skip
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="streamrl-ng-kills-") as tmp:
        tmp_path = Path(tmp)
        redis = EmbeddedRedis(tmp_path / "redis")
        url = redis.start().url
        try:
            with resources_server(tmp_path / "server", args.protocol) as server_url:
                report = kill_run(url, server_url, tmp_path, env, prompts=args.prompts,
                                  faults=args.faults, p=args.p, seed=args.seed,
                                  rollout_workers=args.rollout_workers)  # fmt: skip
        finally:
            redis.stop()
    print(json.dumps({"protocol": args.protocol, **report}, indent=2))


if __name__ == "__main__":
    main()
