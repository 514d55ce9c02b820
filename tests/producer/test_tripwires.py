"""Reward-hacking tripwires: each check fires on the pattern it names and stays quiet on an
honest run; the pausing itself is shown with real processes in
tests/workers/test_mixture_pipeline.py."""

from __future__ import annotations

from streamrl.config import TripwireConfig
from streamrl.producer.tripwires import (
    CHECKS,
    EnvWindows,
    Seen,
    canary,
    collapse,
    disagree,
    restates,
)

CFG = TripwireConfig(window=8, canary_every=5)


def _windows(first: list[Seen], latest: list[Seen], canary: bool = False) -> EnvWindows:
    w = EnvWindows(CFG.window)
    for s in [*first, *latest]:
        w.add(s, canary)
    return w


def _seen(reward: float, length: int = 40, tools: int = 2, **components: float) -> Seen:
    return Seen(reward=reward, length=length, tool_calls=tools, restated=False,
                components=components)  # fmt: skip


def test_reward_up_while_length_or_tool_use_collapses_fires():
    honest = _windows([_seen(0.2)] * 8, [_seen(0.8)] * 8)  # learnt, same effort
    assert collapse(honest, CFG) is None
    short = _windows([_seen(0.2)] * 8, [_seen(0.8, length=5)] * 8)
    assert "completion length fell from 40.0 to 5.0" in collapse(short, CFG)
    no_tools = _windows([_seen(0.2)] * 8, [_seen(0.8, tools=0)] * 8)
    assert "tool calls fell from 2.0 to 0.0" in collapse(no_tools, CFG)
    worse = _windows([_seen(0.8)] * 8, [_seen(0.2, length=5)] * 8)  # shorter and worse: no
    assert collapse(worse, CFG) is None


def test_restated_prompts_are_told_from_answers():
    prompt = "The secret word is maple. Say only the secret word, nothing else."
    assert restates(prompt, "Sure! " + prompt)
    assert not restates(prompt, "maple")
    assert not restates("Say hi.", "Say hi.")  # too short to tell


def test_canaries_that_move_fire():
    steady = _windows([_seen(0.0)] * 8, [_seen(0.1)] * 8, canary=True)
    assert canary(steady, CFG) is None
    moved = _windows([_seen(0.0)] * 8, [_seen(1.0)] * 8, canary=True)
    assert "moved +1.00 from 0.00" in canary(moved, CFG)
    known = TripwireConfig(window=8, canary_every=5, canary_reward=0.0)  # known unsolvable
    assert "moved +1.00" in canary(_windows([_seen(1.0)] * 8, [], canary=True), known)


def test_a_judge_that_disagrees_with_its_programmatic_check_fires():
    agree = [_seen(1.0, judge=0.9, exact=1.0, fmt=1.0)] * 8
    assert disagree(_windows(agree, agree), CFG) is None
    gamed = [_seen(0.5, judge=1.0, exact=0.0, fmt=1.0)] * 5 + agree[:3]  # 5 of 8 apart
    why = disagree(_windows(agree, gamed), CFG)
    assert why.startswith("the judge and exact disagree (by more than 0.5) on 5 of the latest 8")
    assert "judge mean 0.96, exact mean 0.38" in why
    only_fmt = TripwireConfig(window=8, disagree_with=["fmt"])  # exact is not a check of it
    assert disagree(_windows(agree, gamed), only_fmt) is None
    assert disagree(_windows(agree, gamed), TripwireConfig(window=8, disagree=0.75)) is None
    assert disagree(_windows(agree, agree[:5] + gamed[:3]), CFG) is None  # 3 of 8: under half
    no_check = [_seen(1.0, judge=0.0)] * 8  # a judge alone: nothing to disagree with
    assert disagree(_windows(no_check, no_check), CFG) is None


def test_every_check_is_a_named_plain_function():
    assert [name for name, _ in CHECKS] == ["collapse", "restate", "canary", "disagree"]
