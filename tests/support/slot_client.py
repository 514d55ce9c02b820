"""A process of the ``openai`` backend with ``max_inflight_per_server``: CONCURRENCY request
loops against a server for SECONDS (or until SIGTERM), then one JSON line (turns answered,
seconds waited for slots). What a rollout worker's policy does, without the rest of the worker.

``python -m tests.support.slot_client URL REDIS_URL RUN BOUND LEASE_S CONCURRENCY SECONDS``
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from streamrl.config import PolicyConfig
from streamrl.policy.base import PolicyRequest
from streamrl.policy.openai import OpenAIPolicy
from streamrl.schema import Message, Task


async def main(url: str, redis_url: str, run: str, bound: int, lease_s: float,
               concurrency: int, seconds: float) -> None:  # fmt: skip
    config = PolicyConfig(
        backend="openai",
        base_url=url + "/v1",
        model="policy",
        max_new_tokens=8,
        options={"trust_env": False, "max_inflight_per_server": bound, "slot_lease_s": lease_s,
                 "extra_body": {"ignore_eos": True}},
    )  # fmt: skip
    policy = OpenAIPolicy(config, None, redis_url=redis_url, run=run)
    turns = 0
    end = time.monotonic() + seconds

    def stop() -> None:
        nonlocal end
        end = 0.0  # the loops end after the requests they are in

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)

    async def loop(i: int) -> None:
        nonlocal turns
        n = 0
        while time.monotonic() < end:
            text = [Message(role="user", content=f"Count to {n}.")]
            task = Task(task_id=f"c{i}-{n}:0", prompt_id=f"c{i}-{n}", k=0, group_size=1,
                        env="copy", input=text)  # fmt: skip
            await policy.respond(PolicyRequest(task=task, items=list(task.input), tools=[]))
            turns += 1
            n += 1

    print("started", flush=True)
    try:
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
    finally:
        waited = policy._slots.waited_s if policy._slots is not None else 0.0
        await policy.close()
    print(json.dumps({"turns": turns, "waited_s": round(waited, 2)}), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), float(a[4]), int(a[5]), float(a[6])))
