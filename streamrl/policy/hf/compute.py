"""One thread for all of a policy's torch work: loading the model, every decode call, every
weight load.

torch's CPU build runs its parallel kernels on GNU OpenMP, which gives every OS thread that
starts a parallel region a pool of workers of its own. Once the process holds more of those
threads than it has CPUs, every pool's workers stop spinning between regions and sleep on a
futex, so each region then pays a wake-up: on a 2-core VM a small element-wise op took
70-110 us instead of 7-10, and a float32 matmul ran at half speed. A model loaded in the main
thread and decoded in ``asyncio.to_thread``'s pool (up to six threads, each with a pool of its
own) was in that state: SmolLM2-135M's decode loop took 23.7-24.0 s for 64 x 64 tokens
against 16.4-18.9 s in the main thread. With every torch call on this one thread (and none
on the main thread) there is a single pool, as in a plain script.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    """A one-thread executor: ``run`` waits for a call from synchronous code, ``call`` awaits
    it from the event loop. Never call ``run`` from the thread itself (it would wait on
    itself)."""

    def __init__(self, name: str = "streamrl-torch") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def close(self) -> None:
        """Lets a running call finish; later calls raise ``RuntimeError``."""
        self._pool.shutdown(wait=False)
