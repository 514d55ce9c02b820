"""The shared retry policy: attempt counts, what the caller sees at the end, and the waits."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.http import Retryable, RetryPolicy


class Flaky:
    """Fails ``failures`` times with ``error``, then returns "ok"; counts its calls."""

    def __init__(self, failures: int, error: type[BaseException] = Retryable) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "ok"

    async def acall(self) -> str:
        return self()


class GaveUp(Exception):
    pass


def give_up(e: BaseException) -> GaveUp:
    return GaveUp(f"last: {e}")


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("failures", [0, 1, 2])
def test_retries_until_an_attempt_succeeds(asynchronous, failures):
    flaky, seen = Flaky(failures), []
    policy = RetryPolicy(tries=3)
    failed = lambda i, e: seen.append((i, str(e)))  # noqa: E731
    if asynchronous:
        out = asyncio.run(policy.acall(flaky.acall, give_up, failed))
    else:
        out = policy.call(flaky, give_up, failed)
    assert out == "ok" and flaky.calls == failures + 1
    assert seen == [(i, f"failure {i + 1}") for i in range(failures)]


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("tries", [1, 3])
def test_gives_up_with_the_last_error_after_every_try(asynchronous, tries):
    flaky, seen = Flaky(99), []
    policy = RetryPolicy(tries=tries)
    failed = lambda i, e: seen.append(i)  # noqa: E731
    with pytest.raises(GaveUp, match=f"last: failure {tries}$"):
        if asynchronous:
            asyncio.run(policy.acall(flaky.acall, give_up, failed))
        else:
            policy.call(flaky, give_up, failed)
    assert flaky.calls == tries and seen == list(range(tries))


@pytest.mark.parametrize("failures", [0, 1])
def test_an_error_not_worth_a_retry_passes_through_unchanged(failures):
    calls = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise Retryable("again")
        raise KeyError("not retryable")

    with pytest.raises(KeyError, match="not retryable"):
        RetryPolicy(tries=5).call(attempt, give_up)
    assert len(calls) == failures + 1


def test_waits_grow_exponentially_with_jitter_up_to_the_cap():
    policy = RetryPolicy(tries=6, backoff_s=1.0, backoff_max_s=4.0)
    for n, base in [(2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0), (6, 4.0)]:
        waits = [policy.wait_before(n) for _ in range(200)]
        assert all(base / 2 <= w < base for w in waits), (n, min(waits), max(waits))
        assert max(waits) - min(waits) > base / 10  # jittered, not constant
