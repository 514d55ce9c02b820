"""PrimeIntellect ``verifiers`` 0.4 through streamrl's real rq workers: the ``verifiers``
environment with the taskset verifiers ships for NeMo Gym resources servers (``nemo_gym``),
its episodes run by verifiers' ``null`` harness (its chat program, a ``uv`` script, in the
``subprocess`` runtime) against the rollout worker's policy endpoint, scored in the verifier
worker by the task's own ``@vf.reward`` (``nemo_gym``: the server's ``/verify``). The resources
server is streamrl's stateful test server (tests/support/nemo_gym_server.py): a row's session
starts at ``initial_count`` and ``/verify`` rewards 1.0 when the counter equals
``expected_count``, so half the prompts must score 1.0 and half 0.0, whatever the model says.

The work horse SIGKILLs itself right after answering a model turn (``--kills`` times: the
episodes then in flight die with it): each is redone from the start as the next attempt.

    .venv-verifiers/bin/python bench/verifiers_env.py [--prompts 4] [--kills 1]
        [--model models/smollm2-135m]   (the hf backend on that model instead of scripted)

Needs ``verifiers==0.4.0`` and ``uv`` importable/on PATH in the Python that runs it
(``python tests/support/verifiers_venv.py`` makes ``.venv-verifiers``). Prints one JSON
object."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from streamrl import schema  # noqa: E402
from streamrl.config import (  # noqa: E402
    PolicyConfig,
    RolloutConfig,
    RunConfig,
    StreamConfig,
    VerifyConfig,
)
from streamrl.envs.registry import make_env  # noqa: E402
from streamrl.local.embedded import EmbeddedRedis  # noqa: E402
from streamrl.local.pipeline import LocalPipeline, xrange_all  # noqa: E402
from streamrl.producer.produce import Producer  # noqa: E402
from streamrl.schema import Message  # noqa: E402
from tests.support.nemo_gym import free_port, resources_server, sessions  # noqa: E402
from tests.support.nemo_gym_kills import FAILPOINT_DIR, FAILPOINTS  # noqa: E402


def rows(prompts: int) -> list[dict]:
    """Prompt i: the counter starts at i; even prompts expect i (reward 1.0), odd ones i + 1."""
    return [
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": f"Prompt {i}: say anything."}]
            },
            "initial_count": i,
            "expected_count": i + (i % 2),
            "label": f"p{i}",
        }
        for i in range(prompts)
    ]


def last_answer(items: list) -> str | None:
    return next((i.content for i in reversed(items) if isinstance(i, Message)), None)


def run(prompts: int, kills: int, group_size: int, directory: Path, model: str = "") -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    dataset = directory / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows(prompts)))
    fault_dir = directory / "faults"
    fault_dir.mkdir(exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # uv, for verifiers' uv scripts
    worker_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "STREAMRL_PYTHON": sys.executable,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
    }
    if kills:
        worker_env |= {FAILPOINTS: f"after_policy_turn:{kills}", FAILPOINT_DIR: str(fault_dir)}
    server_dir = directory / "server"
    with EmbeddedRedis(directory / "redis") as redis, resources_server(server_dir) as url:
        redis_url = redis.url
        endpoint = f"127.0.0.1:{free_port()}"
        options = {
            "taskset": "nemo_gym",
            "taskset_args": {"dataset": str(dataset), "task": {"resources_url": url}},
            "policy_endpoint": endpoint,
            "retries": 2,
        }
        cfg = RunConfig(
            run="vf",
            env="verifiers",
            group_size=group_size,
            env_options=options,
            policy=PolicyConfig(backend="hf", model=model, max_new_tokens=24)
            if model
            else PolicyConfig(wrong_rate=0.0, options={"token_vocab": 64}),
            rollout=RolloutConfig(lease_seconds=30, max_concurrent=16),
            verify=VerifyConfig(retries=1, timeout_s=60),
            streams=StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30),
        )
        t0 = time.time()
        drained = True
        with LocalPipeline(cfg, url=redis_url, directory=directory / "run",
                           worker_env=worker_env) as pipe:  # fmt: skip
            env = make_env("verifiers", **options)
            Producer(pipe.r, "vf").from_env(env, prompts, group_size, env_spec="verifiers")
            pipe.start_workers(rollout=1, verify=1)
            try:
                pipe.wait_groups(prompts, timeout=300)
            except TimeoutError:
                drained = False
            seconds = time.time() - t0
            samples = [
                s
                for _, f in xrange_all(pipe.r, pipe.keys.groups)
                for s in schema.GROUP.decode(f[b"p"]).samples
            ]
            entries = lambda key: [f[b"p"] for _, f in xrange_all(pipe.r, key)]  # noqa: E731
            dead = [schema.DEAD_LETTER.decode(p) for p in entries(pipe.keys.dead)]
            scored = [schema.SCORE.decode(p) for p in entries(pipe.keys.scored)]
            completed, dropped = pipe.stat("groups_completed"), pipe.stat("groups_dropped")
        server = sessions(url)
    expected = {f"{env.name}-s0-{i:07d}": float(i % 2 == 0) for i in range(prompts)}
    wrong = attempts = redone = 0
    untokened = turns = logprobs = 0
    rewards_in_info = set()
    for s in samples:
        state = msgspec.msgpack.decode(s.trajectory.state)
        attempts += state.get("attempt", 0)
        redone += state.get("redone", 0)
        wrong += s.score.reward != expected[s.trajectory.prompt_id]
        rewards_in_info |= set((s.score.info or {}).get("rewards", {}))
        turns += len(s.trajectory.turns)
        untokened += not s.trajectory.turns or any(not t.token_ids for t in s.trajectory.turns)
        logprobs += sum(len(t.logprobs) == len(t.token_ids) > 0 for t in s.trajectory.turns)
    ids = [s.task_id for s in scored]
    verifies = [r["verifies"] for r in server.values()]
    example = samples[0].score if samples else None
    return {
        "prompts": prompts,
        "samples": prompts * group_size,
        "kills": dict(Counter(p.read_text().split()[0] for p in fault_dir.iterdir())),
        "drained": drained,
        "seconds": round(seconds, 1),
        "groups_completed": completed,
        "groups_dropped": dropped,
        "scored": len(samples),
        "scored_wrong": wrong,
        "scored_twice": len(ids) - len(set(ids)),
        "mean_reward": sum(s.score.reward for s in samples) / max(1, len(samples)),
        "dead_letters": {d.task_id: d.reason[:300] for d in dead},
        "attempts_beyond_first": attempts,
        "redone_after_the_worker_lost_it": redone,
        "model_turns_recorded": turns,
        "samples_without_tokens": untokened,
        "turns_with_a_logprob_per_token": logprobs,
        "example_answer": last_answer(samples[0].trajectory.items) if samples else None,
        "reward_names_in_info": sorted(rewards_in_info),
        "example_score": {
            "reward": example.reward,
            "components": example.components,
            "info": example.info,
            "verifier": [example.verifier, example.verifier_version],
        }
        if example
        else None,
        "server_sessions": len(server),
        "server_sessions_verified_twice": sum(v > 1 for v in verifies),
        "server_sessions_verified": sum(v == 1 for v in verifies),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--model", default="", help="an hf model directory (default: scripted)")
    args = ap.parse_args()
    model = str(Path(args.model).resolve()) if args.model else ""
    with tempfile.TemporaryDirectory(prefix="vf-bench-") as d:
        out = run(args.prompts, args.kills, args.group_size, Path(d), model)
    print(json.dumps(out, indent=1))
    ok = (out["drained"] and out["scored"] == out["samples"] and not out["scored_wrong"]
          and not out["scored_twice"] and not out["dead_letters"])  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
