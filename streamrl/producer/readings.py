"""What the producer's gate reads: the pipeline's accounting in samples (``Gate``: what was
pushed, what the learner has settled, and the ``Window`` that bounds the rest) and Redis
memory against its budget (``Memory``, read by ``memory_budget``).

A sample is *useful* once the learner applied it or accepted it into the batch it is filling
(``groups_applied`` and ``waiting_groups``), and *dropped* once the learner read and discarded
its group (stale, zero-variance, no tokens, invalid) or its group was dropped at assembly
because a sample failed. Of the dropped samples, the zero-variance ones (every sample of the
group scored alike: solved or no signal) are the normal cost of GRPO sampling, not a fault:
they leave the pipeline like any other, but the drop budget charges only the rest (``faults``)."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from streamrl.bus.keys import Keys
from streamrl.bus.values import as_str

_LEARNER_FIELDS = (
    "max_in_flight",
    "samples_consumed",
    "groups_applied",
    "waiting_groups",
    "dropped_invalid",
    "dropped_zero_variance",
    "updated_at",
    "verdict",
    "max_staleness",
)

MiB = 1024 * 1024


@dataclass
class Gate:
    """One reading of the pipeline's accounting, in samples."""

    pushed: int  # entries ever added to the tasks stream
    useful: int  # applied by the learner, or accepted into its open batch
    dropped: int  # dropped by the learner (stale, zero-variance, ...) or at group assembly
    debt: int  # fault drops that training has not paid for yet: they stay in flight
    limit: int | None  # the window, (max_staleness + 1) x batch samples
    learner: bool  # a learner has reported
    filling: bool = False  # the learner holds a part-filled batch: it waits for more groups
    zero_variance: int = 0  # of ``dropped``, the zero-variance samples: never charged
    verdict: str = ""  # the learner stopped itself: the task is solved (learner.outcomes)
    held: int = 0  # accepted samples still in flight (synchronous runs: ``Counters.held``)

    @property
    def faults(self) -> int:
        """Dropped samples the drop budget charges: stale, no tokens, invalid, failed."""
        return max(0, self.dropped - self.zero_variance)

    @property
    def pipeline(self) -> int:
        """Samples still on their way to the learner (queued, rolling out, verifying, unread)."""
        return self.pushed - self.useful - self.dropped

    @property
    def in_flight(self) -> int:
        return self.pipeline + self.debt + self.held


@dataclass
class Memory:
    """Redis memory against the budget, now and as the samples in flight will leave it."""

    used: int  # bytes, INFO used_memory
    budget: int  # bytes
    source: str  # which setting the budget comes from
    coming: int = 0  # bytes the samples already pushed will add as they are rolled out,
    # scored and grouped (a trajectory and its group entry weigh far more than a task)
    per_sample: int = 0  # bytes one more pushed sample will cost once it is grouped
    in_flight: int = 0  # samples pushed and not yet grouped (or dead-lettered)

    @property
    def over(self) -> bool:
        return self.used >= self.budget

    def fits(self, n: int) -> bool:
        """Whether ``n`` more samples, and everything already in flight, fit in the budget."""
        return self.used + self.coming + n * self.per_sample < self.budget


@dataclass(frozen=True)
class Window:
    """How many samples may be in flight. The learner publishes its own limit
    (``max_in_flight``) once it runs; until then ``fallback`` holds, and with ``override``
    it holds for good (experiments that fix the window). Neither: no window."""

    fallback: int | None = None
    override: bool = False

    def limit(self, published: int) -> int | None:
        return self.fallback if self.override or not published else published


@dataclass(frozen=True)
class Counters:
    """The raw counts a gate is built from."""

    pushed: int
    useful: int
    dropped: int
    published_limit: int  # the learner's max_in_flight (0: not published)
    learner: bool  # a learner has reported
    filling: bool  # the learner holds a part-filled batch
    zero_variance: int = 0  # of ``dropped``, samples of zero-variance groups
    verdict: str = ""  # the learner's verdict ("" while it has none)
    # Samples the learner accepted but has not trained on, when they still count as in
    # flight: at ``max_staleness = 0`` (synchronous training) the next batch may only be
    # pushed once this one is trained and its version published, or it is sampled by the
    # version being trained and dropped as stale: a sync run would crawl on its drop budget.
    held: int = 0

    @property
    def faults(self) -> int:
        """Dropped samples that the drop budget charges (``dropped`` less zero-variance)."""
        return max(0, self.dropped - self.zero_variance)


def read_counters(r: redis.Redis, keys: Keys, shards: list[Keys], group_size: int) -> Counters:
    """The learner's progress hash and, summed over the shards, the tasks pushed and the
    groups dropped at assembly: one round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.hmget(keys.learner, list(_LEARNER_FIELDS))
    for k in shards:
        pipe.xinfo_stream(k.tasks)
        pipe.hget(k.stats, "groups_dropped")
    learner, *per_shard = pipe.execute(raise_on_error=False)
    pushed, assembly_dropped = _shard_totals(per_shard)
    if isinstance(learner, Exception):
        raise learner
    limit, consumed, applied, waiting, invalid, zero_variance = (
        int(float(x or 0)) for x in learner[:6]
    )
    useful = (applied + waiting) * group_size
    synchronous = learner[8] is not None and int(float(learner[8])) == 0
    dropped = max(0, consumed + invalid * group_size - useful) + assembly_dropped * group_size
    return Counters(
        pushed=pushed,
        useful=useful,
        dropped=dropped,
        published_limit=limit,
        learner=any(x is not None for x in learner),
        filling=waiting > 0,
        zero_variance=min(dropped, zero_variance * group_size),
        verdict=as_str(learner[7] or ""),
        held=waiting * group_size if synchronous else 0,
    )


def _shard_totals(per_shard: list) -> tuple[int, int]:
    """(tasks ever pushed, groups dropped at assembly) from each shard's XINFO STREAM and
    ``groups_dropped`` replies."""
    added, assembly_dropped = 0, 0
    for info, shard_dropped in zip(per_shard[::2], per_shard[1::2], strict=True):
        if isinstance(info, redis.ResponseError):  # no tasks stream yet: nothing pushed
            info = {"entries-added": 0}
        elif isinstance(info, Exception):
            raise info
        if isinstance(shard_dropped, Exception):
            raise shard_dropped
        added += int(info["entries-added"])
        assembly_dropped += int(shard_dropped or 0)
    return added, assembly_dropped
