"""Reward-hacking tripwires: each check fires on the pattern it names and stays quiet on an
honest run; the pausing itself is shown with real processes in
tests/workers/test_mixture_pipeline.py."""

from __future__ import annotations

from streamrl.config import TripwireConfig
from streamrl.producer.tripwires import CHECKS, EnvWindows, Seen, canary, collapse, restates

CFG = TripwireConfig(window=8, canary_every=5)


def _windows(first: list[Seen], latest: list[Seen], canary: bool = False) -> EnvWindows:
    w = EnvWindows(CFG.window)
    for s in [*first, *latest]:
        w.add(s, canary)
    return w


def _seen(reward: float, length: int = 40, tools: int = 2) -> Seen:
    return Seen(reward=reward, length=length, tool_calls=tools, restated=False)


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


def test_every_check_is_a_named_plain_function():
    assert [name for name, _ in CHECKS] == ["collapse", "restate", "canary"]
