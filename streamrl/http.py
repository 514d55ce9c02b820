"""The one HTTP client module: which httpx API is installed, and the retry policy that the
openai backend, the nemo-gym environment and the verifier worker share.

Retries are tenacity's (``Retrying`` / ``AsyncRetrying`` built from one ``RetryPolicy``), so
a sync loop and its async twin cannot drift apart: ``tries`` attempts; before attempt n + 1 a
sleep of ``min(backoff_max_s, backoff_s * 2 ** (n - 1))`` times a factor drawn from [0.5, 1)
(jitter that spreads clients out without ever shrinking a wait to nothing), or longer where the
failed attempt's ``Retryable`` names a wait of its own (``after_s``: a server's
``Retry-After``). An attempt asks for another by raising ``Retryable`` (or, with ``retry_on``,
any error of the listed types); anything else ends the loop at once, unchanged. When the
tries run out, ``give_up`` turns the last attempt's error into the one the caller raises.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

_T = TypeVar("_T")


def httpx_api() -> Any:
    """The ``httpx`` API: ``httpx`` if installed, else ``httpx2`` (its maintained successor,
    which ``huggingface_hub`` already pulls in; ``pip install streamrl[openai]``)."""
    try:
        import httpx

        return httpx
    except ImportError:
        try:
            import httpx2

            return httpx2
        except ImportError:
            raise ImportError(
                "streamrl's HTTP clients (the openai backend, nemo-gym, the judge) need httpx or "
                "httpx2: pip install 'streamrl[openai]' (or [nemo-gym], [judge])"
            ) from None


def server_root(base_url: str) -> str:
    """``http://host:8000/v1/`` and ``http://host:8000`` both name an OpenAI-compatible
    server's root."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class Retryable(Exception):
    """Raised by an attempt to ask for another; its message says why (the last one is what
    ``give_up`` reports). ``after_s``: wait at least this long before the next attempt (what
    the server asked for with ``Retry-After``)."""

    def __init__(self, message: str, after_s: float = 0.0) -> None:
        super().__init__(message)
        self.after_s = after_s


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts, how long between them, and which errors are worth another.

    The first attempt runs as a plain call: tenacity's bookkeeping costs ~13 µs a call, which
    the verifier worker would pay on every trajectory (a third of its time in the scripted
    pipeline benchmark). Only after a failure does tenacity take over, counting on from 2."""

    tries: int
    backoff_s: float = 0.0
    backoff_max_s: float = 0.0
    retry_on: tuple[type[BaseException], ...] = (Retryable,)

    def call(
        self,
        attempt: Callable[[], _T],
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None = None,
    ) -> _T:
        """``attempt()`` until it returns, raises an error not in ``retry_on``, or the tries
        run out (then ``give_up(last error)`` is raised). ``on_failure(index, error)`` sees
        every failed attempt, the last one too (``index`` counts from 0)."""
        try:
            return attempt()
        except self.retry_on as e:
            first = e
        self._first_failed(first, give_up, on_failure)
        time.sleep(self.wait_before(2, first))
        return tenacity.Retrying(**self._tenacity(give_up, on_failure))(attempt)

    async def acall(
        self,
        attempt: Callable[[], Awaitable[_T]],
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None = None,
    ) -> _T:
        """``call`` for a coroutine function; the waits are ``asyncio.sleep``."""
        try:
            return await attempt()
        except self.retry_on as e:
            first = e
        self._first_failed(first, give_up, on_failure)
        await asyncio.sleep(self.wait_before(2, first))
        return await tenacity.AsyncRetrying(**self._tenacity(give_up, on_failure))(attempt)

    def wait_before(self, n: int, failed: BaseException | None = None) -> float:
        """Seconds to sleep before attempt ``n`` (n >= 2): capped exponential backoff times a
        factor from [0.5, 1), jitter that spreads clients out without shrinking a wait to 0;
        at least the ``after_s`` that the ``failed`` attempt asked for."""
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (n - 2))
        return max(base * (0.5 + random.random() / 2), getattr(failed, "after_s", 0.0))

    def _first_failed(
        self,
        error: BaseException,
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None,
    ) -> None:
        if on_failure is not None:
            on_failure(0, error)
        if self.tries <= 1:
            raise give_up(error) from None

    def _tenacity(
        self,
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None,
    ) -> dict[str, Any]:
        """Attempts 2..tries (tenacity's attempt_number 1 is our attempt 2)."""

        def raise_last(state: tenacity.RetryCallState) -> Any:
            raise give_up(_error(state))

        def after(state: tenacity.RetryCallState) -> None:
            if on_failure is not None:
                on_failure(state.attempt_number, _error(state))

        return {
            "stop": tenacity.stop_after_attempt(self.tries - 1),
            "wait": lambda state: self.wait_before(state.attempt_number + 2, _error(state)),
            "retry": tenacity.retry_if_exception_type(self.retry_on),
            "after": after,
            "retry_error_callback": raise_last,
        }


def _error(state: tenacity.RetryCallState) -> BaseException:
    error = state.outcome.exception() if state.outcome is not None else None
    assert error is not None  # tenacity retries (and gives up) only after a failed attempt
    return error
