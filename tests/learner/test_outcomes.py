"""Runs that stop learning end with a verdict: the real learner on the tiny model tells solved
groups from no-signal ones, shows their rates, stops with ``stop_when_solved`` (checkpoint,
publish, one line) and says in one line when the groups have had no signal for long."""

from __future__ import annotations

import msgspec
import pytest
import structlog
from groupdata import feed, make_groups, run_learner_thread

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.defaults import LEARNER_GROUP
from streamrl.learner.checkpoint import latest_checkpoint, read_state
from streamrl.learner.config import LearnerConfig
from streamrl.ops.status import collect
from streamrl.ops.views import status_table
from streamrl.schema import Group


def _run(url, run, cfg, **kw):
    """On a thread (run_learner installs signal handlers only on the main thread), with the
    learner's log lines captured."""
    with structlog.testing.capture_logs() as logs:
        state = run_learner_thread(url, run, cfg, **kw)
    return state, logs


def _cfg(tiny_dir, tmp_path, **kw) -> LearnerConfig:
    base = dict(
        model=str(tiny_dir), output_dir=str(tmp_path / "out"), torch_threads=1, batch_groups=2,
        checkpoint_every=100, sync_every=3, keep_policy_versions=2, lr=1e-3, block_ms=100,
    )  # fmt: skip
    return LearnerConfig(**{**base, **kw})


def _scored(group: Group, reward: float) -> Group:
    """``group`` with every sample scored ``reward`` (all solved at 1.0, no signal below)."""
    samples = [
        msgspec.structs.replace(s, score=msgspec.structs.replace(s.score, reward=reward))
        for s in group.samples
    ]
    return msgspec.structs.replace(group, samples=samples, reward_mean=reward, reward_std=0.0)


def _hash(r, run: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(Keys(run).learner).items()}


def _status_text(r, run: str) -> str:
    """What `streamrl status` prints for the run."""
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(status_table(collect(r, run)))
    return console.export_text()


def test_solved_and_no_signal_groups_are_told_apart(redis_url, r, tiny_dir, tmp_path):
    """Zero-variance groups at the copy task's max_reward (1.0) are solved, those all alike
    below it have no signal; both stay in ``dropped_zero_variance`` (their sum), and the
    progress hash shows their rates over the last ``solved_window`` groups."""
    keys = Keys("kinds")
    ensure_groups(r, keys)
    groups = make_groups(tiny_dir, 10, seed=3)
    assert all(g.reward_std > 0 for g in groups[:4])
    solved = [_scored(g, 1.0) for g in groups[4:7]]
    no_signal = [_scored(groups[7], 0.0), _scored(groups[8], 2 / 3)]  # all wrong; all partial
    # trainable groups last: both steps' windows commit (and checkpoint) everything read
    feed(r, keys, [*solved, *no_signal, *groups[:4]])
    cfg = _cfg(tiny_dir, tmp_path, solved_window=10, logging_steps=1)
    state, logs = _run(redis_url, "kinds", cfg, exit_when_idle=0.5)

    c = state.counters
    assert (c.groups_solved, c.groups_no_signal, c.dropped_zero_variance) == (3, 2, 5)
    assert c.groups_applied == 4 and state.step == 2 and state.verdict == ""
    h = _hash(r, "kinds")
    assert h["status"] == "stopped" and h["verdict"] == ""
    assert (int(h["groups_solved"]), int(h["groups_no_signal"])) == (3, 2)
    assert int(h["dropped_zero_variance"]) == 5  # old readers see the sum
    # the window holds the 9 groups read: 3 solved, 2 without signal, 4 to learn from
    assert int(h["outcome_window"]) == 9
    assert float(h["solved_rate"]) == pytest.approx(3 / 9, abs=1e-4)
    assert float(h["no_signal_rate"]) == pytest.approx(2 / 9, abs=1e-4)
    assert h["no_signal"] == ""  # 2 in a row is not a long stretch (default 200)
    text = _status_text(r, "kinds")
    assert "33% of the last 9 groups" in text and "22% of the last 9 groups" in text
    steps = [e for e in logs if e["event"] == "step"]
    assert steps and {"solved_rate", "no_signal_rate"} <= steps[-1].keys()


def test_solved_reward_sets_the_top(redis_url, r, tiny_dir, tmp_path):
    """``solved_reward`` overrides the environment's max_reward: at 2/3, groups all at 2/3
    are solved too."""
    keys = Keys("top")
    ensure_groups(r, keys)
    groups = make_groups(tiny_dir, 3, seed=4)
    feed(r, keys, [_scored(groups[0], 1.0), _scored(groups[1], 2 / 3), _scored(groups[2], 0.0)])
    _run(redis_url, "top", _cfg(tiny_dir, tmp_path, solved_reward=2 / 3), exit_when_idle=0.5)
    h = _hash(r, "top")  # no step: the counts are the open window's
    assert (int(h["groups_solved"]), int(h["groups_no_signal"])) == (2, 1)


def test_stop_when_solved_checkpoints_publishes_and_says_so(redis_url, r, tiny_dir, tmp_path):
    """Trainable groups, then solved ones: once 4 of the last 5 groups are solved the learner
    stops by itself (no total_steps, no idle exit), publishes its last step's weights,
    checkpoints, and says why in one line. Like a stop at total_steps, the entries after its
    last step stay pending for a later learner."""
    keys = Keys("solved")
    ensure_groups(r, keys)
    groups = make_groups(tiny_dir, 12, seed=7)
    trainable = [g for g in groups if g.reward_std > 0][:4]
    assert len(trainable) == 4
    solved = [_scored(g, 1.0) for g in groups[:8]]
    feed(r, keys, [*trainable, *solved])
    cfg = _cfg(tiny_dir, tmp_path, stop_when_solved=0.8, solved_window=5)
    state, logs = _run(redis_url, "solved", cfg, exit_when_idle=60)  # "stopped" if idle

    expected = (
        "solved: 80% of the last 5 groups were solved by every sample at step 2 "
        "(stop_when_solved 0.8)"
    )
    assert state.verdict == expected
    assert state.step == 2 and state.counters.groups_consumed == 4  # committed by step 2
    assert [e["event"] for e in logs].count(expected) == 1  # one line, once
    h = _hash(r, "solved")
    assert h["status"] == "solved" and h["verdict"] == expected
    assert int(h["groups_solved"]) == 4 and int(h["groups_consumed"]) == 8  # the 8th decides
    assert float(h["solved_rate"]) == pytest.approx(0.8)
    text = _status_text(r, "solved")
    assert expected in text and "80% of the last 5 groups" in text
    # published: step 2 is not a sync step (sync_every 3), so the verdict published it
    announced = [schema.POLICY_VERSION.decode(f[b"p"]) for _, f in r.xrange(keys.policy)]
    assert announced[-1].step == 2 and announced[-1].version == state.policy_version == 1
    # checkpointed, with the verdict; the 4 trainable entries it covers are acked, the 8
    # after them (read, or delivered and left at the verdict) wait for a later learner
    ckpt = latest_checkpoint(tmp_path / "out" / "checkpoints")
    assert ckpt is not None and read_state(ckpt).verdict == expected
    assert read_state(ckpt).step == 2
    assert r.xpending(keys.groups, LEARNER_GROUP)["pending"] == 8

    # a learner restarted from there starts without a verdict and trains on
    again, _ = _run(redis_url, "solved", _cfg(tiny_dir, tmp_path), exit_when_idle=0.5)
    h = _hash(r, "solved")
    assert again.verdict == "" and h["verdict"] == "" and h["status"] == "stopped"
    assert int(h["groups_consumed"]) == 12 and int(h["groups_solved"]) == 8


def test_a_long_stretch_without_signal_says_so_once(redis_url, r, tiny_dir, tmp_path):
    """Every group all wrong: after ``no_signal_warn_groups`` of them in a row the learner
    says so in one warning line and in its progress hash, and goes on (no stop by default)."""
    keys = Keys("nosignal")
    ensure_groups(r, keys)
    groups = [_scored(g, 0.0) for g in make_groups(tiny_dir, 7, seed=9)]
    feed(r, keys, groups)
    cfg = _cfg(tiny_dir, tmp_path, no_signal_warn_groups=3)
    state, logs = _run(redis_url, "nosignal", cfg, exit_when_idle=0.5)

    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings  # once per stretch, not once per group
    line = warnings[0]["event"]
    assert line.startswith("no signal: the last 3 groups each scored alike below the top")
    assert "mean reward 0" in line
    h = _hash(r, "nosignal")
    assert int(h["groups_no_signal"]) == 7 and int(h["groups_consumed"]) == 7
    assert h["no_signal"] == line and float(h["no_signal_rate"]) == 1.0
    assert h["status"] == "stopped" and state.verdict == ""
    assert line in " ".join(_status_text(r, "nosignal").split())  # may wrap


def _fake_env(group: Group, env: str) -> Group:
    samples = [
        msgspec.structs.replace(s, trajectory=msgspec.structs.replace(s.trajectory, env=env))
        for s in group.samples
    ]
    return msgspec.structs.replace(group, samples=samples)


def test_an_environment_the_learner_cannot_load_uses_the_highest_reward_seen(tiny_dir):
    """The documented fallback: without the environment's max_reward, a zero-variance group
    is solved at the highest reward seen so far; the window keeps the last groups only."""
    from streamrl.learner.outcomes import NO_SIGNAL, SIGNAL, SOLVED, Outcomes

    base = make_groups(tiny_dir, 1, seed=1)[0]
    assert base.reward_std > 0
    top = max(s.score.reward for s in base.samples)
    gone = "no_such_module_anywhere:Env"
    out = Outcomes(window=3)
    assert out.see(_fake_env(base, gone), False) == SIGNAL
    assert out.see(_fake_env(_scored(base, top), gone), True) == SOLVED
    assert out.see(_fake_env(_scored(base, top / 2), gone), True) == NO_SIGNAL
    assert out.see(_fake_env(_scored(base, top), gone), True) == SOLVED
    assert list(out.recent) == [SOLVED, NO_SIGNAL, SOLVED]  # the first fell out
    assert out.rate(SOLVED) == pytest.approx(2 / 3, abs=1e-4)
    # the copy environment loads: its max_reward (1.0) is the top, whatever was seen
    copy = Outcomes(window=3)
    assert copy.see(_scored(base, 0.5), True) == NO_SIGNAL
