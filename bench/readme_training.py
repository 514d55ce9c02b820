"""Run the README's Training section as written, from a fresh directory, and report whether and
when the reward of the scored feed reaches the target.

    python bench/readme_training.py [--seconds 300] [--target 0.9]
        [--lr 1e-3] [--entropy-coef 0.01 | --entropy-target 0.3]

It starts a private Redis (`streamrl up`), builds the tiny model into models/tiny, starts two
rollout workers and a verifier (`streamrl worker ...`), the learner and the producer on
`configs/copy-tiny.toml`, exactly the README's commands, and polls the `scored` stream. With
`--lr` / `--entropy-coef` it runs a copy of the config with those learner settings changed (the
collapse experiment). Prints one JSON line. Every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from streamrl.local.procs import stop_all

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "copy-tiny.toml"


def _config(
    dst: Path, lr: float | None, entropy_coef: float | None, learner: dict[str, str] | None = None
) -> Path:
    text = CONFIG.read_text()
    if lr is not None:
        text = re.sub(r"(?m)^lr = .*$", f"lr = {lr}", text)
    if entropy_coef is not None:
        text = text.replace("[learner]\n", f"[learner]\nentropy_coef = {entropy_coef}\n")
    for key, value in (learner or {}).items():
        text = text.replace("[learner]\n", f"[learner]\n{key} = {value}\n")
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / "copy-tiny.toml"
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--window", type=int, default=512, help="scored samples in the mean")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--entropy-coef", type=float, default=None)
    ap.add_argument("--entropy-target", type=float, default=None, help="adaptive entropy")
    ap.add_argument(
        "--learner", action="append", default=[], metavar="KEY=VALUE",
        help="any other [learner] setting (TOML value), e.g. entropy_coef_step=0.01",
    )  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="readme-training-"))
    extra = dict(kv.split("=", 1) for kv in args.learner)
    if args.entropy_target is not None:
        extra["entropy_target"] = str(args.entropy_target)
    cfg = _config(work / "configs", args.lr, args.entropy_coef, extra)
    bin_ = Path(sys.executable).parent
    srl = str(bin_ / "streamrl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("STREAMRL_REDIS_URL", None)
    procs: list[subprocess.Popen] = []
    logs = work / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str], extra: dict | None = None) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen(argv, cwd=work, env={**env, **(extra or {})}, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    t0 = time.monotonic()
    result: dict = {
        "config": str(cfg), "lr": args.lr, "entropy_coef": args.entropy_coef,
        "entropy_target": args.entropy_target, "learner": args.learner,
    }  # fmt: skip
    try:
        start("up", [srl, "up"])
        url_file = work / ".streamrl" / "redis.url"
        while not url_file.exists():
            time.sleep(0.05)
        url = url_file.read_text().strip()
        env["RQ_REDIS_URL"] = url
        subprocess.run(
            [sys.executable, "-c", "from streamrl.models.tiny import save_tiny; "
             "save_tiny('models/tiny')"], cwd=work, env=env, check=True,
        )  # fmt: skip
        for name in ("rollout-1", "rollout-2", "verify"):
            start(name, [srl, "worker", name.split("-")[0]])
        start("learn", [srl, "learn", "--config", str(cfg)])
        start("produce", [srl, "produce", "--config", str(cfg), "--count", "100000"])
        r = redis.Redis.from_url(url)
        from streamrl import schema
        from streamrl.bus.keys import Keys

        keys = Keys("copy-tiny")
        reached = None
        recent: list[float] = []
        while time.monotonic() - t0 < args.seconds:
            time.sleep(1.0)
            rows = r.xrevrange(keys.scored, count=args.window)
            recent = [
                s.reward
                for s in (schema.SCORE.decode(f[b"p"]) for _, f in rows)
                if s.reward is not None
            ]
            if len(recent) == args.window and sum(recent) / len(recent) >= args.target:
                reached = time.monotonic() - t0
                break
        learner = {k.decode(): v.decode() for k, v in r.hgetall(keys.learner).items()}
        result.update(
            reached_target=reached is not None,
            seconds_to_target=round(reached, 1) if reached else None,
            seconds=round(time.monotonic() - t0, 1),
            reward_last=round(sum(recent) / len(recent), 4) if recent else None,
            learner_step=int(learner.get("step", 0)),
            entropy=learner.get("entropy"),
            entropy_coef_last=learner.get("entropy_coef"),
            groups_consumed=int(learner.get("groups_consumed", 0)),
            dropped_fraction_zero_variance=learner.get("dropped_fraction_zero_variance"),
            dropped_fraction_stale=learner.get("dropped_fraction_stale"),
            target=args.target,
            logs=str(logs),
        )
    finally:
        stop_all(procs)  # a warm rq shutdown would wait out a 600 s lease
        if not args.keep:
            shutil.rmtree(work / "models", ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
