"""A process of the ``openai`` backend that syncs a server's weights and then idles: what a
rollout worker's policy does when a version is announced, for tests that SIGKILL it mid-swap.

``python -m tests.support.server_updater URL REDIS_URL RUN UPDATE_LOCK_S``
"""

from __future__ import annotations

import asyncio
import sys

from streamrl.config import PolicyConfig
from streamrl.policy.openai import OpenAIPolicy


async def main(url: str, redis_url: str, run: str, update_lock_s: float) -> None:
    config = PolicyConfig(
        backend="openai",
        base_url=url + "/v1",
        model="tiny",
        options={"trust_env": False, "sync": "weights", "reload_check_s": 0,
                 "update_lock_s": update_lock_s},
    )  # fmt: skip
    policy = OpenAIPolicy(config, None, redis_url=redis_url, run=run, worker="updater")
    await policy.refresh()
    print("synced", policy.version, policy.reload_error, flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    url, redis_url, run, lock_s = sys.argv[1:5]
    asyncio.run(main(url, redis_url, run, float(lock_s)))
