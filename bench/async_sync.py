"""Asynchronous against synchronous training through the whole pipeline, on one machine:
learner tokens per second and optimizer steps per hour with rollouts and learner overlapping
(``max_staleness`` ≥ 1) and alternating (``max_staleness = 0``).

    python bench/async_sync.py [--model DIR | --random-like DIR [--vocab tiny]] [--seconds 90]
        [--staleness 1,0] [--rollout-workers 2] [--max-new-tokens 64] [--out FILE]

Each mode is a fresh run, every role its own process on a private Redis, as a user starts
them (``streamrl up``, ``streamrl worker rollout`` × N, ``streamrl worker verify``,
``streamrl learn``, ``streamrl produce``), on ``configs/smollm2-copy.toml`` with the model,
the staleness and the token budget replaced. ``device = "auto"``: the learner and the ``hf``
rollout workers run on the GPU when there is one. ``--random-like DIR`` builds a model with
DIR's architecture and tokenizer and random weights (throughput does not depend on what the
weights say; a random model rarely stops early, so every completion costs the full budget).

The window measured starts at the learner's first step (start-up and the first batch are
reported apart as ``cold_start_s``) and lasts ``--seconds``. Figures per mode: steps, trained
tokens (the learner's own count of completion tokens that carried loss) per second, steps per
hour, the learner's busy fraction (its step time over the window: what is left is waiting for
groups) and, where ``nvidia-smi`` exists, the GPU's mean utilisation and memory. Prints one JSON
object (and writes it to ``--out``); the ratio ``async / sync`` is of tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2-copy.toml"
RUN = "smollm2-copy"


def random_like(src: Path, dst: Path, tiny_vocab: bool, seed: int = 0) -> Path:
    """A model directory with ``src``'s architecture and seeded random weights, and ``src``'s
    tokenizer or (``tiny_vocab``) the tiny model's word-level one over the copy task's
    symbols. A random model over 49k tokens almost never writes a symbol, so every group
    scores 0 and is dropped (no signal) before the learner trains on it; over the symbols
    its rewards spread and every step trains, on ``src``'s transformer body."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.models.tiny import build_tokenizer

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(src)
    tok = build_tokenizer() if tiny_vocab else None
    if tok is not None:
        config.vocab_size = len(tok)
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(dst)
    if tok is not None:
        tok.save_pretrained(dst)
        return dst
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst


def _config(model: Path, staleness: int, args) -> str:
    """``configs/smollm2-copy.toml`` with the model, staleness and budgets of this mode."""
    text = CONFIG.read_text()
    subs = {
        r'^model = ".*"$': f'model = "{model}"',
        r"^max_staleness = .*$": f"max_staleness = {staleness}",
        r"^max_new_tokens = .*$": f"max_new_tokens = {args.max_new_tokens}",
        r"^max_completion_length = .*$": f"max_completion_length = {args.max_new_tokens}",
        r"^batch_groups = .*$": f"batch_groups = {args.batch_groups}",
        r"^checkpoint_every = .*$": "checkpoint_every = 1000",
    }
    for pat, new in subs.items():
        text = re.sub(pat, new, text, flags=re.M)
    text = text.replace("[learner]\n", "[learner]\nlogging_steps = 1\n", 1)
    # workers look for a new version before every batch: a synchronous run samples each batch
    # with the version its predecessor produced (the same setting in both modes)
    # (and batch up to 64 episodes in one decode); a lease reloads the model as it starts,
    # so leases last two minutes instead of 30 s
    opts = "options = { reload_check_s = 0.0, max_batch = 64 }"
    text = text.replace("[policy]\n", f"[policy]\n{opts}\n", 1)
    text += "\n[rollout]\nlease_seconds = 120\n"
    return text


class _GpuSampler(threading.Thread):
    """``nvidia-smi`` utilisation and memory once a second, while ``on`` is set."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.on = threading.Event()
        self.done = threading.Event()
        self.util: list[float] = []
        self.mem: list[float] = []

    def run(self) -> None:
        q = [
            "nvidia-smi",
            "--query-gpu=utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
        ]
        while not self.done.wait(1.0):
            if not self.on.is_set():
                continue
            out = subprocess.run(q, capture_output=True, text=True).stdout.split("\n")[0]
            with_units = [float(x) for x in out.split(",")] if out.strip() else []
            if len(with_units) == 2:
                self.util.append(with_units[0])
                self.mem.append(with_units[1])


def _steps(log: Path) -> list[dict]:
    """The learner's ``step`` lines (JSON log), each with its time as a Unix timestamp."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if '"step"' not in line:
            continue
        try:
            rec = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        if rec.get("event") == "step":
            rec["t"] = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append(rec)
    return out


def run_mode(staleness: int, model: Path, args, base: Path) -> dict:
    """One run at ``staleness``; every process it starts is stopped by its PID."""
    from streamrl.local.procs import stop_all

    work = base / f"staleness{staleness}"
    logs = work / "logs"
    logs.mkdir(parents=True)
    cfg = work / "run.toml"
    cfg.write_text(_config(model, staleness, args))
    script = Path(sys.executable).with_name("streamrl")  # else not installed: run the module
    srl = [str(script)] if script.exists() else [sys.executable, "-m", "streamrl.cli"]
    env = {**os.environ, "STREAMRL_LOG_FORMAT": "json"}
    procs: list[subprocess.Popen] = []

    def start(role: str, argv: list[str]) -> None:
        out = open(logs / f"{role}.log", "wb")  # noqa: SIM115
        err = subprocess.STDOUT
        procs.append(subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err,
                                      start_new_session=True))  # fmt: skip

    gpu = _GpuSampler() if shutil.which("nvidia-smi") else None
    if gpu:
        gpu.start()
    launched = time.time()
    try:
        start("up", [*srl, "up"])
        url_file = work / ".streamrl" / "redis.url"
        while not url_file.exists():
            time.sleep(0.05)
        env["RQ_REDIS_URL"] = url_file.read_text().strip()
        for i in range(args.rollout_workers):
            start(f"rollout{i}", [*srl, "worker", "rollout"])
        start("verify", [*srl, "worker", "verify"])
        start("learn", [*srl, "learn", "--config", str(cfg)])
        start("produce", [*srl, "produce", "--config", str(cfg), "--count", "100000"])
        learn_log = logs / "learn.log"
        deadline = time.time() + args.cold_limit
        while not _steps(learn_log):
            if time.time() > deadline or procs[-2].poll() is not None:
                tail = learn_log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"staleness {staleness}: no learner step\n{tail}")
            time.sleep(0.5)
        first = _steps(learn_log)[0]["t"]
        if gpu:
            gpu.on.set()
        print(f"  staleness {staleness}: first step {first - launched:.1f} s after launch",
              file=sys.stderr)  # fmt: skip
        while time.time() < first + args.seconds:
            time.sleep(1.0)
        if gpu:
            gpu.on.clear()
    finally:
        stop_all(procs)
        if gpu:
            gpu.done.set()
    steps = [s for s in _steps(learn_log) if first < s["t"] <= first + args.seconds]
    tokens = sum(int(s.get("tokens", 0)) for s in steps)
    busy = sum(float(s.get("step_seconds", 0.0)) for s in steps)
    out = {
        "max_staleness": staleness,
        "cold_start_s": round(first - launched, 1),
        "window_s": args.seconds,
        "steps": len(steps),
        "steps_per_hour": round(len(steps) * 3600 / args.seconds, 1),
        "trained_tokens": tokens,
        "tokens_per_s": round(tokens / args.seconds, 1),
        "learner_busy_fraction": round(busy / args.seconds, 3),
        "reward_mean_last": steps[-1].get("reward_mean") if steps else None,
        "logs": str(logs),
    }
    if gpu and gpu.util:
        out["gpu_util_mean"] = round(sum(gpu.util) / len(gpu.util), 1)
        out["gpu_mem_max_mib"] = max(gpu.mem)
    print(f"  {json.dumps(out)}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--random-like", type=Path, default=None,
                    help="random weights, this directory's architecture")  # fmt: skip
    ap.add_argument("--vocab", choices=("model", "tiny"), default="model",
                    help="with --random-like: its tokenizer, or the copy symbols'")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=90.0, help="window measured per mode")
    ap.add_argument("--cold-limit", type=float, default=300.0, help="seconds to a first step")
    ap.add_argument("--staleness", default="1,0", help="max_staleness of each mode, in order")
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--batch-groups", type=int, default=8, help="8 samples each")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="srl-async-sync-"))
    model = args.model
    if args.random_like is not None:
        model = random_like(args.random_like, base / "model", args.vocab == "tiny")
    try:
        modes = [run_mode(int(s), model.resolve(), args, base) for s in args.staleness.split(",")]
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    import torch

    by = {m["max_staleness"]: m for m in modes}
    sync = by.get(0)
    result = {
        "bench": "async_sync",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": str(args.random_like or args.model),
        "weights": "random" if args.random_like else "trained",
        "vocab": args.vocab if args.random_like else "model",
        "rollout_workers": args.rollout_workers,
        "max_new_tokens": args.max_new_tokens,
        "samples_per_step": args.batch_groups * 8,
        "modes": modes,
    }
    if sync and sync["tokens_per_s"]:
        result["async_over_sync"] = {
            str(s): round(m["tokens_per_s"] / sync["tokens_per_s"], 2) for s, m in by.items() if s
        }
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
