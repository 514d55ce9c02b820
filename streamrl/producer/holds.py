"""Why the producer may not push now: the gate's reasons and the messages that say so."""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.producer.readings import Gate, Memory, MiB

# why a producer waits (``Hold.reason``, and ``reason`` in the producer_state hash)
WINDOW_FULL = "window_full"
NO_LEARNER = "no_learner"
DROP_BUDGET = "drop_budget"
MEMORY_BUDGET = "memory_budget"


@dataclass
class Hold:
    """Why the producer waits; what ``on_wait`` is told and ``streamrl status`` shows."""

    reason: str  # WINDOW_FULL | NO_LEARNER | DROP_BUDGET | MEMORY_BUDGET
    message: str
    in_flight: int
    limit: int | None
    since: float  # time.time() when this wait began
    debt: int = 0
    used_mb: float | None = None
    budget_mb: float | None = None


def hold(
    n: int, gate: Gate, mem: Memory | None, since: float, max_drop_fraction: float
) -> Hold | None:
    """Why ``n`` more samples may not be pushed now, or None when they may: memory first,
    then the window (full because of debt, of no learner, or of samples in flight)."""
    return _memory_hold(n, gate, mem, since) or _window_hold(n, gate, since, max_drop_fraction)


def _memory_hold(n: int, gate: Gate, mem: Memory | None, since: float) -> Hold | None:
    """Always held while Redis is over its budget; held while the projection with ``n`` more
    samples reaches it, except for a learner stuck on a part-filled batch with nothing else
    on its way: holding then would deadlock the run (one push over, at most)."""
    if mem is None:
        return None
    stuck = gate.filling and mem.in_flight == 0
    if not (mem.over or (not mem.fits(n) and not stuck)):
        return None
    used, budget = mem.used / MiB, mem.budget / MiB
    return Hold(
        MEMORY_BUDGET,
        f"memory budget: Redis uses {used:.0f} MB of {budget:.0f} MB ({mem.source}), "
        f"and the {mem.in_flight} samples in flight will add {mem.coming / MiB:.0f} "
        "MB; waiting for the pipeline and trimming (or raise [admission] "
        "redis_memory_mb)",
        gate.in_flight, gate.limit, since, gate.debt, round(used, 1), round(budget, 1),
    )  # fmt: skip


def _window_hold(n: int, gate: Gate, since: float, max_drop_fraction: float) -> Hold | None:
    """Held while ``n`` more samples would take the in-flight count past the window; nothing
    in flight always admits (even a push larger than the window), so the learner never waits
    for a batch that the gate keeps from filling."""
    limit = gate.limit
    if limit is None or gate.in_flight + n <= limit or gate.in_flight <= 0:
        return None
    if gate.debt > 0:
        msg = (
            f"drop budget exhausted: {gate.faults} samples dropped for a fault (stale, no "
            f"tokens, invalid or a failed sample) against {gate.useful} trained; {gate.debt} "
            f"dropped samples wait for training to pay for them (max_drop_fraction "
            f"{max_drop_fraction}). Do the rollout workers load new policies? "
            "(Raise [admission] max_drop_fraction if this much waste is expected.)"
        )
        return Hold(DROP_BUDGET, msg, gate.in_flight, limit, since, gate.debt)
    if not gate.learner:
        msg = (
            f"window full: {gate.in_flight} samples pushed (limit {limit}) and no learner "
            "has reported yet; start `streamrl learn`"
        )
        return Hold(NO_LEARNER, msg, gate.in_flight, limit, since)
    msg = (
        f"window full: {gate.in_flight} samples in flight (limit {limit} = "
        "(max_staleness + 1) x batch); waiting for the learner to consume"
    )
    if gate.verdict:  # it stopped itself: say why instead of waiting silently
        msg += f"; the learner stopped: {gate.verdict}"
    return Hold(WINDOW_FULL, msg, gate.in_flight, limit, since)
