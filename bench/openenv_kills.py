"""Rollout workers killed mid-episode against a real OpenEnv server (the echo environment
``openenv init`` writes from openenv-core's template, in its own process and virtualenv, made
on first use by tests/support/openenv_server.py): how many steps the server applied twice in
the sessions that finished the episodes, how many samples were scored twice, lost, dead-lettered
or scored wrong. Real rq workers, a private Redis; the work horse SIGKILLs itself at the fault
points of ``streamrl.envs._failpoints`` (figures: tests/support/openenv_kills.py).

    python bench/openenv_kills.py [--prompts 40] [--faults after_open:1,after_tool_send:3]
                                  [--p 1.0] [--seed 0]

Prints one JSON object."""

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
from tests.support.openenv_kills import kill_run  # noqa: E402
from tests.support.openenv_server import Server, echo_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--faults", default="after_open:1,after_tool_send:3")
    ap.add_argument("--p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="streamrl-openenv-kills-") as tmp:
        tmp_path = Path(tmp)
        with EmbeddedRedis(tmp_path / "redis") as redis, Server(echo_env(tmp_path)) as server:
            figures = kill_run(server.url, redis.url, env, tmp_path / "run",
                               run="openenv-kills", prompts=args.prompts, faults=args.faults,
                               p=args.p, seed=args.seed, timeout_s=900)  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
