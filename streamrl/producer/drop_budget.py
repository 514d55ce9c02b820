"""The drop budget: dropped samples settle only as fast as training pays for them.

Samples dropped for a *fault* (stale, no tokens or invalid groups the learner read and
discarded, and groups dropped at assembly because a sample failed) settle from a *waste
balance*: it starts at one window (``limit``), grows by ``r = max_drop_fraction / (1 -
max_drop_fraction)`` per useful sample (0.9: nine dropped samples per applied one), shrinks
by one per dropped sample, and is capped at ``max(1, r) x limit`` so that a long healthy run
does not bank credit that a later failure could spend. A negative balance is *debt*: dropped
samples that stay in flight::

    in_flight = pushed - useful - dropped + debt;   push n when in_flight + n <= limit

Zero-variance groups (every sample scored alike: all solved, or no signal) are not faults:
they are the normal cost of GRPO sampling (DAPO keeps drawing until its batch is full), and a
run that is doing well has more of them every step. They leave the pipeline (``dropped``) so
the producer refills, but they are never charged: the balance sees only the fault drops.

So a run that applies nothing (workers that never load new policies: every group stale)
pushes at most about one window plus the balance (at most ``(1 + max(1, r)) x limit``
samples) and then waits with reason ``drop_budget``, instead of pushing as fast as the
learner can throw groups away. ``max_drop_fraction = 1`` turns the budget off (every drop
settles at once).

A restarted learner republishes the counters of its checkpoint and re-reads the entries
after it: the balance keeps high-water marks of the useful and dropped counts, so replayed
groups are neither credited nor charged twice. The balance and the marks are kept in the
``producer_state`` hash, so a restarted producer keeps its debt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DropBudget:
    """The waste balance (samples) and the high-water marks it has been charged up to."""

    max_drop_fraction: float
    balance: float | None = None  # None: not started (no window yet)
    seen_useful: int = 0
    seen_dropped: int = 0

    def __post_init__(self) -> None:
        f = self.max_drop_fraction
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"max_drop_fraction must be in [0, 1], got {f}")

    @property
    def ratio(self) -> float | None:
        """Dropped samples one useful sample pays for; None: no budget (every drop settles)."""
        f = self.max_drop_fraction
        return None if f >= 1.0 else round(f / (1.0 - f), 9)  # 0.9 -> 9, not 9.000000000000002

    def settle(self, useful: int, dropped: int, limit: int | None) -> int:
        """Credit the useful samples and charge the fault drops (``dropped``: stale, no
        tokens, invalid, failed; never zero-variance) not seen before; the debt (dropped
        samples the balance does not cover), 0 without a window or a budget."""
        debt = 0
        ratio = self.ratio
        if limit and ratio is not None:
            if self.balance is None:
                self.balance = float(limit)  # one window at start
            credit = max(0, useful - self.seen_useful)
            charge = max(0, dropped - self.seen_dropped)
            cap = max(1.0, ratio) * limit
            self.balance = min(cap, self.balance + ratio * credit - charge)
            debt = math.ceil(-self.balance) if self.balance < 0 else 0
        self.seen_useful = max(self.seen_useful, useful)
        self.seen_dropped = max(self.seen_dropped, dropped)
        return debt

    def fields(self) -> dict[str, str | int | float]:
        """What a restarted producer needs to carry on (``restore``)."""
        return {
            "waste_balance": round(self.balance, 3) if self.balance is not None else "",
            "seen_useful": self.seen_useful,
            "seen_dropped": self.seen_dropped,
        }

    def restore(self, balance: bytes | None, useful: bytes | None, dropped: bytes | None) -> None:
        """Carry on from the ``fields`` a previous producer of this run left."""
        if balance not in (None, b"", ""):
            self.balance = float(balance)
            self.seen_useful = int(useful or 0)
            self.seen_dropped = int(dropped or 0)


@dataclass
class Probe:
    """The way out of debt. While the gate is closed on debt with nothing left in the pipeline
    (so nothing could ever be applied and pay it), one push gets through every ``every_s``
    (0: never); once the cause is fixed, a probe's groups are applied and pay the debt back."""

    every_s: float
    count: int = 0  # probes let through
    last: float = -math.inf  # time.monotonic() of the last one

    def due(self, waiting_since: float, now: float) -> bool:
        if self.every_s <= 0:
            return False
        return now - max(waiting_since, self.last) >= self.every_s

    def take(self, now: float) -> None:
        self.count += 1
        self.last = now
