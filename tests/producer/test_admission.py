"""Admission control that cannot be fooled: fault drops (stale, no tokens, invalid, failed)
settle only as fast as training pays for them, zero-variance drops (a solved task) never close
the gate, Redis memory has a budget, and a healthy run never deadlocks.

The learner is simulated by writing its progress hash the way ``streamrl.learner.loop``
reports it (``samples_consumed``, ``groups_applied``, ``waiting_groups``, ``dropped_*``,
``max_in_flight``); the producer, the gate and Redis are real."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import msgspec
import pytest

from streamrl.bus.keys import Keys
from streamrl.config import RunConfig, load_toml
from streamrl.envs import make_env
from streamrl.ops.status import collect
from streamrl.producer import (
    DROP_BUDGET,
    MEMORY_BUDGET,
    NO_LEARNER,
    WINDOW_FULL,
    Hold,
    LearnerAdmission,
    Producer,
)
from streamrl.producer.admission import push_samples
from tests.support.waiting import wait_for

G = 4  # group size
WAIT_S = 60.0  # generous deadline for conditions that a healthy machine meets in well under 1 s


def pushed(r, run: str) -> int:
    return r.xinfo_stream(Keys(run).tasks)["entries-added"]


class FakeLearner:
    """Reads the tasks stream a group at a time (all of a prompt's samples are pushed together)
    and reports the hash fields the real learner reports. ``decide(group_index)`` returns
    ``"apply"``, ``"zero_variance"`` or ``"stale"``."""

    def __init__(self, r, run: str, limit: int, batch_groups: int = 2):
        self.r, self.keys, self.batch_groups = r, Keys(run), batch_groups
        self.last = "0-0"
        self.groups = 0
        self.c = dict.fromkeys(
            (
                "groups_consumed",
                "groups_applied",
                "dropped_stale",
                "dropped_zero_variance",
                "dropped_invalid",
                "samples_consumed",
                "waiting_groups",
            ),
            0,
        )
        self.c["max_in_flight"] = limit
        self.r.hset(self.keys.learner, mapping=self.c)

    def consume(self, decide: Callable[[int], str]) -> int:
        rows = self.r.xrange(self.keys.tasks, min=f"({self.last}", count=1000)
        for eid, _ in rows:
            self.last = eid.decode()
        c = self.c
        for _ in range(len(rows) // G):
            kind = decide(self.groups)
            self.groups += 1
            c["groups_consumed"] += 1
            c["samples_consumed"] += G
            if kind == "apply":
                c["waiting_groups"] += 1
                if c["waiting_groups"] == self.batch_groups:
                    c["groups_applied"] += self.batch_groups
                    c["waiting_groups"] = 0
            else:
                c[f"dropped_{kind}"] += 1
        if rows:
            self.r.hset(self.keys.learner, mapping=c)
        return len(rows)


def start_producer(r, run: str, adm: LearnerAdmission, prompts: int, batch: int = 2 * G):
    done: dict = {}

    def go():
        try:
            done["result"] = Producer(r, run, admission=adm, batch_samples=batch).from_env(
                make_env("counter"), prompts, G
            )
        except BaseException as e:  # reported by the test
            done["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, done


def state(r, run: str) -> dict:
    return {k.decode(): v.decode() for k, v in r.hgetall(Keys(run).producer_state).items()}


# ---------------------------------------------------------------------------- drop budget


def test_drops_hold_the_producer_after_one_window_plus_the_allowance(r, run_name):
    """The incident: workers never load new policies, so every group is stale. The producer
    pushes one window, then one more window of drops settles (the start allowance), and then
    it waits, saying why; nothing is applied, so nothing more settles."""
    limit = 16
    told: list[Hold] = []
    adm = LearnerAdmission(
        r, run_name, G, limit=limit, on_wait=told.append, drop_probe_s=0, tell_every_s=0.05
    )
    learner = FakeLearner(r, run_name, limit)
    t, done = start_producer(r, run_name, adm, prompts=50)

    def held() -> bool:
        learner.consume(lambda i: "stale")
        return state(r, run_name).get("reason") == DROP_BUDGET

    wait_for(held, "the producer to wait on its drop budget", WAIT_S, every=0.01)
    learner.consume(lambda i: "stale")
    assert pushed(r, run_name) == 2 * limit  # one window + one window of drops, no more
    assert learner.c["groups_applied"] == 0 and learner.c["dropped_stale"] == 2 * limit // G
    assert t.is_alive() and "result" not in done
    st = state(r, run_name)
    assert st["state"] == "waiting" and "drop budget exhausted" in st["message"]
    assert adm.gate().debt == limit
    wait_for(lambda: told, "on_wait to be told", WAIT_S, every=0.01)
    assert told[-1].reason == DROP_BUDGET and "dropped for a fault (stale" in told[-1].message
    assert "zero-variance" not in told[-1].message

    # The cause is fixed (groups are trainable again). Nothing is left in the pipeline that
    # could pay the debt, so a probe push goes through; its groups are applied, pay the debt,
    # and the producer runs to the end.
    adm.drop_probe_s = 0.05

    def finished() -> bool:
        learner.consume(lambda i: "apply")
        return not t.is_alive()

    wait_for(finished, "the producer to finish after the fix", WAIT_S, every=0.01)
    assert "error" not in done and done["result"].prompts == 50
    assert adm.probes >= 1
    assert learner.c["groups_applied"] + learner.c["waiting_groups"] == 50 - 2 * limit // G


def test_debt_is_paid_by_applied_samples(r, run_name):
    """Unit view of the rule: settled = useful + dropped - debt, debt = what the balance
    (one window + 9 per useful sample, minus 1 per dropped sample) does not cover."""
    keys = Keys(run_name)
    Producer(r, run_name).from_env(make_env("counter"), 8, G)  # 32 samples
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 28})
    r.hset(keys.learner, mapping={"groups_consumed": 7, "dropped_stale": 7})
    adm = LearnerAdmission(r, run_name, G)
    gate = adm.gate()
    assert (gate.dropped, gate.useful, gate.debt, gate.pipeline) == (28, 0, 12, 4)
    assert gate.in_flight == 16
    hold = adm.hold(8, gate, None, time.time())
    assert hold is not None and hold.reason == DROP_BUDGET
    # the last group is applied (it waits in the learner's open batch): 4 useful samples pay
    # for 36 dropped ones
    r.hset(keys.learner, mapping={"groups_consumed": 8, "samples_consumed": 32})
    r.hset(keys.learner, "waiting_groups", 1)
    gate = adm.gate()
    assert (gate.useful, gate.debt, gate.in_flight) == (4, 0, 0)
    assert adm.hold(8, gate, None, time.time()) is None
    assert adm.balance == 16 - 28 + 9 * 4  # one window - 28 dropped + 9 x 4 useful


def test_a_restarted_learner_is_not_charged_twice(r, run_name):
    """A learner restarted from its checkpoint republishes older counters and re-reads the
    entries after it; the replayed drops must not be charged again."""
    keys = Keys(run_name)
    Producer(r, run_name).from_env(make_env("counter"), 6, G)  # 24 samples
    adm = LearnerAdmission(r, run_name, G)
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 24})
    r.hset(keys.learner, mapping={"groups_consumed": 6, "dropped_stale": 6})
    assert adm.gate().debt == 8
    # restart: back to the checkpoint (2 groups), then the replay reaches 6 groups again
    r.hset(keys.learner, mapping={"samples_consumed": 8, "groups_consumed": 2})
    gate = adm.gate()
    assert gate.debt == 8 and gate.pipeline == 16  # the replayed entries count as in flight
    r.hset(keys.learner, mapping={"samples_consumed": 24, "groups_consumed": 6})
    assert adm.gate().debt == 8


def test_zero_variance_drops_never_exhaust_the_drop_budget(r, run_name):
    """The copy run at step ~560: the task is solved and ~90 % of groups are zero-variance
    (here all of them). They leave the pipeline, so the producer refills the window, and are
    never charged: it pushes everything without a probe and never waits on its drop budget,
    where the same run with stale groups waits after two windows (the test above)."""
    limit, prompts = 16, 50
    adm = LearnerAdmission(r, run_name, G, limit=limit, drop_probe_s=0)
    learner = FakeLearner(r, run_name, limit)
    t, done = start_producer(r, run_name, adm, prompts=prompts)

    def finished() -> bool:
        learner.consume(lambda i: "zero_variance")
        gate = adm.gate()
        assert gate.debt == 0 and gate.faults == 0 and gate.zero_variance == gate.dropped
        return not t.is_alive()

    wait_for(finished, "the producer to push everything", WAIT_S, every=0.01)
    learner.consume(lambda i: "zero_variance")
    assert "error" not in done and done["result"].prompts == prompts
    assert pushed(r, run_name) == prompts * G > 2 * limit
    assert adm.probes == 0 and DROP_BUDGET not in adm.waits
    assert learner.c["groups_applied"] == 0 and learner.c["dropped_zero_variance"] == prompts
    assert adm.balance == limit  # nothing charged, nothing credited
    adm.finish()
    st = state(r, run_name)
    assert int(st["dropped_zero_variance"]) == int(st["dropped"]) == prompts * G
    assert int(st["debt"]) == 0


def test_stale_drops_still_exhaust_the_budget_among_zero_variance_ones(r, run_name):
    """Zero-variance groups do not hide a fault: with every other group stale and nothing
    applied, the stale ones alone run the balance into debt."""
    keys = Keys(run_name)
    Producer(r, run_name).from_env(make_env("counter"), 16, G)  # 64 samples
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 64})
    r.hset(
        keys.learner,
        mapping={"groups_consumed": 16, "dropped_stale": 8, "dropped_zero_variance": 8},
    )
    adm = LearnerAdmission(r, run_name, G)
    gate = adm.gate()
    assert (gate.dropped, gate.zero_variance, gate.faults) == (64, 32, 32)
    assert gate.debt == 32 - 16  # 32 stale samples against a balance of one window
    hold = adm.hold(8, gate, None, time.time())
    assert hold is not None and hold.reason == DROP_BUDGET
    assert "32 samples dropped for a fault" in hold.message


def test_a_restarted_producer_keeps_the_debt(r, run_name):
    keys = Keys(run_name)
    Producer(r, run_name).from_env(make_env("counter"), 8, G)
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 32})
    r.hset(keys.learner, mapping={"groups_consumed": 8, "dropped_stale": 8})
    first = LearnerAdmission(r, run_name, G)
    gate = first.gate()
    assert gate.debt == 16
    first.finish()
    second = LearnerAdmission(r, run_name, G)
    assert second.gate().debt == 16
    assert state(r, run_name)["state"] == "done"


def test_max_drop_fraction_one_lets_every_drop_settle(r, run_name):
    keys = Keys(run_name)
    Producer(r, run_name).from_env(make_env("counter"), 8, G)
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 32})
    adm = LearnerAdmission(r, run_name, G, max_drop_fraction=1.0)
    assert adm.in_flight() == (0, 16)
    with pytest.raises(ValueError):
        LearnerAdmission(r, run_name, G, max_drop_fraction=1.5)


# ---------------------------------------------------------------------------- memory budget


def _ballast(r, mb: int) -> None:
    for i in range(mb):
        r.set(f"ballast:{i}", b"x" * (1024 * 1024))


def test_memory_budget_holds_the_producer_until_memory_falls(r, run_name):
    _ballast(r, 24)
    used = r.info("memory")["used_memory"] / 2**20
    adm = LearnerAdmission(r, run_name, G, redis_memory_mb=used - 8, memory_check_s=0.05)
    t, done = start_producer(r, run_name, adm, prompts=4)
    wait_for(
        lambda: state(r, run_name).get("reason") == MEMORY_BUDGET,
        "a memory hold",
        WAIT_S,
        every=0.01,
    )
    st = state(r, run_name)
    assert st["state"] == "waiting" and "[admission] redis_memory_mb" in st["message"]
    assert float(st["used_memory_mb"]) >= float(st["memory_budget_mb"])
    assert r.exists(Keys(run_name).tasks) == 0  # nothing was pushed
    r.delete(*[f"ballast:{i}" for i in range(24)])
    t.join(timeout=WAIT_S)
    assert not t.is_alive() and done["result"].samples == 16
    assert state(r, run_name)["state"] == "running"


def test_memory_budget_follows_maxmemory(r, run_name):
    _ballast(r, 24)
    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", str(used + 4 * 2**20))  # 80 % of it is below what is used
    try:
        adm = LearnerAdmission(r, run_name, G, redis_memory_mb=0, memory_check_s=0.05)
        t, done = start_producer(r, run_name, adm, prompts=4)
        wait_for(
            lambda: state(r, run_name).get("reason") == MEMORY_BUDGET,
            "a memory hold",
            WAIT_S,
            every=0.01,
        )
        assert "80% of maxmemory" in state(r, run_name)["message"]
        info = collect(r, run_name)["producer"]
        assert info["state"] == "waiting" and info["reason"] == MEMORY_BUDGET
        assert info["waiting_s"] >= 0
        r.delete(*[f"ballast:{i}" for i in range(24)])
        t.join(timeout=WAIT_S)
        assert not t.is_alive() and done["result"].samples == 16
    finally:
        r.config_set("maxmemory", "0")


def _info_calls(r) -> int:
    return int(r.info("commandstats").get("cmdstat_info", {}).get("calls", 0))


@pytest.mark.parametrize("far", [True, False])
def test_memory_is_read_again_before_a_push_only_near_the_budget(r, run_name, far):
    """Far from its budget a push goes on a reading under ``memory_check_s`` old (one every
    push was an INFO and ten stream commands, twice a push); within half of it, every push
    reads memory anew first."""
    _ballast(r, 4)
    used = r.info("memory")["used_memory"] / 2**20
    budget = used * 4 if far else used * 1.5  # the reading leaves 75 % or 33 % of it free
    adm = LearnerAdmission(r, run_name, G, limit=10**6, redis_memory_mb=budget,
                           memory_check_s=3600)  # fmt: skip
    p = Producer(r, run_name, admission=adm, batch_samples=2 * G)
    before = _info_calls(r) + 1  # the info call above counts itself
    p.from_env(make_env("counter"), 20, G)  # ten pushes of two prompts
    assert pushed(r, run_name) == 20 * G
    readings = _info_calls(r) - before
    assert readings == (1 if far else 10), readings


# ---------------------------------------------------------------------------- liveness


def test_healthy_run_with_mostly_zero_variance_groups_never_deadlocks(r, run_name):
    """70 % zero-variance and 5 % stale drops, the rest trained: the producer pushes everything,
    without probes, never running into its drop budget."""
    limit, prompts = 3 * 2 * G, 300  # (max_staleness + 1) x batch of 2 groups
    rng = random.Random(0)
    plan = ["zero_variance"] * 70 + ["stale"] * 5 + ["apply"] * 25
    kinds = [rng.choice(plan) for _ in range(prompts)]
    adm = LearnerAdmission(r, run_name, G, limit=limit, drop_probe_s=0)
    observer = LearnerAdmission(r, run_name, G, limit=limit)  # its own balance, same rule
    learner = FakeLearner(r, run_name, limit)
    t, done = start_producer(r, run_name, adm, prompts=prompts)

    def finished() -> bool:
        learner.consume(lambda i: kinds[i])
        gate = observer.gate()
        assert gate.in_flight <= limit and gate.debt == 0
        return not t.is_alive()

    wait_for(finished, "the producer to push everything", WAIT_S, every=0.01)
    learner.consume(lambda i: kinds[i])
    assert "error" not in done and done["result"].prompts == prompts
    assert adm.probes == 0 and DROP_BUDGET not in adm.waits
    c = learner.c
    assert c["groups_consumed"] == prompts
    assert c["dropped_zero_variance"] == kinds.count("zero_variance")
    assert adm.gate().in_flight == 0  # the open batch counts as settled


def test_no_learner_and_full_window_say_so(r, run_name):
    limit = 8
    adm = LearnerAdmission(r, run_name, G, limit=limit)
    Producer(r, run_name, admission=adm, batch_samples=limit).from_env(make_env("counter"), 2, G)
    gate = adm.gate()
    assert adm.hold(limit, gate, None, 0.0).reason == NO_LEARNER
    FakeLearner(r, run_name, limit)
    hold = adm.hold(limit, adm.gate(), None, 0.0)
    assert hold.reason == WINDOW_FULL and "waiting for the learner" in hold.message
    assert "stopped" not in hold.message
    # a learner that stopped itself (stop_when_solved): the wait says why
    verdict = "solved: 96% of the last 200 groups were solved by every sample at step 612"
    r.hset(Keys(run_name).learner, mapping={"status": "solved", "verdict": verdict})
    hold = adm.hold(limit, adm.gate(), None, 0.0)
    assert hold.reason == WINDOW_FULL and hold.message.endswith(f"the learner stopped: {verdict}")


def test_admission_table_in_run_config(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[admission]\nredis_memory_mb = 256\nmax_drop_fraction = 0.5\n")
    cfg = load_toml(p)
    assert cfg.admission.redis_memory_mb == 256 and cfg.admission.max_drop_fraction == 0.5
    assert RunConfig().admission.redis_memory_mb == 1024
    p.write_text("[admission]\nredis_memory = 256\n")
    with pytest.raises(ValueError, match="unknown field"):
        load_toml(p)
    p.write_text("[admission]\nmax_drop_fraction = 2\n")
    with pytest.raises(ValueError):
        load_toml(p)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=RunConfig) == cfg


# ---------------------------------------------------------------------------- synchronous


def test_a_synchronous_learner_gets_its_next_batch_only_once_this_one_is_trained(r, run_name):
    """At ``max_staleness = 0`` the batch being trained stays in flight: a push made while the
    learner trains would be sampled by the version being replaced and dropped as stale. A part-
    filled batch is topped up a prompt at a time, as ``push_samples`` pushes."""
    keys, batch = Keys(run_name), 2 * G
    learner = {"batch_groups": 2, "max_staleness": 0}
    assert push_samples(learner, G, 256) == G
    assert push_samples({"batch_groups": 2, "max_staleness": 1}, G, 256) == batch
    Producer(r, run_name).from_env(make_env("counter"), 3, G)  # 3 groups pushed
    adm = LearnerAdmission(r, run_name, G)

    def report(**fields) -> Hold | None:
        r.hset(keys.learner, mapping={"max_in_flight": batch, "max_staleness": 0, **fields})
        return adm.hold(G, adm.gate(), None, time.time())

    # one group dropped (zero variance), one accepted, one still on its way: full window
    hold = report(samples_consumed=2 * G, groups_consumed=2, waiting_groups=1,
                  dropped_zero_variance=1)  # fmt: skip
    assert hold is not None and hold.reason == WINDOW_FULL
    # the third group arrives: the batch is full and being trained, nothing on its way
    hold = report(samples_consumed=3 * G, groups_consumed=3, waiting_groups=2)
    assert adm.gate().pipeline == 0
    assert hold is not None and hold.reason == WINDOW_FULL
    # trained, and its version published: the next batch may go
    assert report(groups_applied=2, waiting_groups=0) is None
    # a learner that is not synchronous lets the next batch go while it trains
    r.hset(keys.learner, mapping={"max_staleness": 1, "max_in_flight": 2 * batch})
    r.hset(keys.learner, mapping={"groups_applied": 0, "waiting_groups": 2})
    assert adm.hold(batch, adm.gate(), None, time.time()) is None
