"""The memory budget with real workers: a task grows several-fold after it is pushed (its
trajectory, score and group entry), so a gate that looked only at ``used_memory`` pushed far
past the budget before the workers caught up (193 MB against a 32 MB budget was seen). The
gate projects what the samples in flight will add, and Redis stays within the budget."""

from __future__ import annotations

import threading
import time

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig, RunConfig
from streamrl.defaults import ROLLOUT_GROUP, VERIFY_GROUP
from streamrl.envs import make_env
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.pipeline import LocalPipeline
from streamrl.producer import MEMORY_BUDGET, LearnerAdmission, Producer
from tests.support.waiting import wait_for

MiB = 2**20
HEADROOM_MB = 6
PROMPTS = 3000  # about 40 MB once rolled out, scored and grouped: far past the budget


def _idle(r, keys: Keys) -> bool:
    """Every pushed task has been rolled out and every trajectory scored."""
    for stream, group in ((keys.tasks, ROLLOUT_GROUP), (keys.rollouts, VERIFY_GROUP)):
        (g,) = [x for x in r.xinfo_groups(stream) if x["name"].decode() == group]
        if g["lag"] or g["pending"]:
            return False
    return True


def test_budget_holds_with_the_pipeline_still_to_come(subprocess_env, tmp_path):
    cfg = RunConfig(
        run="mem", env="counter", env_options={"steps": 1}, group_size=4,
        policy=PolicyConfig(wrong_rate=0.0),
    )  # fmt: skip
    # a private server: its used_memory_peak is this test's alone
    with (
        EmbeddedRedis(tmp_path / "redis") as server,
        LocalPipeline(cfg, url=server.url, directory=tmp_path, worker_env=subprocess_env) as p,
    ):
        p.start_workers(rollout=1, verify=1)
        p.wait_ready(1, 1)
        budget = p.r.info("memory")["used_memory"] + HEADROOM_MB * MiB
        # no learner and no window: only the memory budget holds the producer
        adm = LearnerAdmission(p.r, cfg.run, cfg.group_size, redis_memory_mb=budget / MiB)
        done: dict = {}

        def produce() -> None:
            env = make_env("counter", steps=1)
            done["result"] = Producer(p.r, cfg.run, admission=adm).from_env(env, PROMPTS, 4)

        t = threading.Thread(target=produce, daemon=True)
        t.start()
        reason = lambda: p.r.hget(p.keys.producer_state, "reason")  # noqa: E731
        held = lambda: reason() == MEMORY_BUDGET.encode() and _idle(p.r, p.keys)  # noqa: E731
        wait_for(held, "a memory hold with the workers caught up")
        used = [p.r.info("memory")["used_memory"]]
        for _ in range(20):  # held, and it stays held: nothing more gets through
            time.sleep(0.1)
            used.append(p.r.info("memory")["used_memory"])
        assert held()
        pushed = p.r.xinfo_stream(p.keys.tasks)["entries-added"]
        assert pushed < PROMPTS * 4
        assert max(used) < budget, (max(used) / MiB, budget / MiB)
        # the peak also holds what a push or a Lua script needs for a moment
        peak = p.r.info("memory")["used_memory_peak"]
        assert peak <= budget + MiB, (peak / MiB, budget / MiB)
        adm.redis_memory_mb = 0  # lift the budget: the rest goes through
        t.join(timeout=60)
        assert done["result"].samples == PROMPTS * 4  # every prompt, once
