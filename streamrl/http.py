"""The one HTTP client module: which httpx API is installed, and the retry policy that the
openai backend, the nemo-gym environment and the verifier worker share.

Retries are tenacity's (``Retrying`` / ``AsyncRetrying`` built from one ``RetryPolicy``), so
a sync loop and its async twin cannot drift apart: ``tries`` attempts; before attempt n + 1 a
sleep of ``min(backoff_max_s, backoff_s * 2 ** (n - 1))`` times a factor drawn from [0.5, 1)
(jitter that spreads clients out without ever shrinking a wait to nothing). An attempt asks
for another by raising ``Retryable`` (or, with ``retry_on``, any error of the listed types);
anything else ends the loop at once, unchanged. When the tries run out, ``give_up`` turns the
last attempt's error into the one the caller raises.
"""

from __future__ import annotations

import random
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
                "the openai policy backend needs httpx or httpx2: pip install 'streamrl[openai]'"
            ) from None


class Retryable(Exception):
    """Raised by an attempt to ask for another; its message says why (the last one is what
    ``give_up`` reports)."""


class _EqualJitter(tenacity.wait_exponential):
    """Capped exponential backoff times a factor from [0.5, 1)."""

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return super().__call__(retry_state) * (0.5 + random.random() / 2)


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts, how long between them, and which errors are worth another."""

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
        return tenacity.Retrying(**self._tenacity(give_up, on_failure))(attempt)

    async def acall(
        self,
        attempt: Callable[[], Awaitable[_T]],
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None = None,
    ) -> _T:
        """``call`` for a coroutine function; the waits are ``asyncio.sleep``."""
        return await tenacity.AsyncRetrying(**self._tenacity(give_up, on_failure))(attempt)

    def _tenacity(
        self,
        give_up: Callable[[BaseException], BaseException],
        on_failure: Callable[[int, BaseException], None] | None,
    ) -> dict[str, Any]:
        def raise_last(state: tenacity.RetryCallState) -> Any:
            raise give_up(_error(state))

        def after(state: tenacity.RetryCallState) -> None:
            if on_failure is not None:
                on_failure(state.attempt_number - 1, _error(state))

        return {
            "stop": tenacity.stop_after_attempt(self.tries),
            "wait": _EqualJitter(multiplier=self.backoff_s, max=self.backoff_max_s),
            "retry": tenacity.retry_if_exception_type(self.retry_on),
            "after": after,
            "retry_error_callback": raise_last,
        }


def _error(state: tenacity.RetryCallState) -> BaseException:
    error = state.outcome.exception() if state.outcome is not None else None
    assert error is not None  # tenacity retries (and gives up) only after a failed attempt
    return error
