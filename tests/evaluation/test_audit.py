"""The audit passes honest environments and catches lenient, broken and random verifiers."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from click.testing import CliRunner

from streamrl.cli.evaluate import audit_command
from streamrl.envs import Verdict, last_assistant_text, make_env
from streamrl.envs.counter import CounterEnv
from streamrl.envs.registry import BUILTIN
from streamrl.evaluation.audit import AuditReport, make_task, play, run_audit
from streamrl.schema import Message


class LenientCounter(CounterEnv):
    """Credits an answer that merely *contains* the expected number: sprays beat it."""

    def verify(self, task, trajectory, state):
        expected = str(task.data["start"] + sum(task.data["numbers"]))
        return Verdict(reward=float(expected in last_assistant_text(trajectory.items)))


class SloppyToolCounter(CounterEnv):
    """Never checks that the tools were used: wrong-typed tool calls still earn the reward."""

    def verify(self, task, trajectory, state):
        expected = str(task.data["start"] + sum(task.data["numbers"]))
        return Verdict(reward=float(last_assistant_text(trajectory.items).strip() == expected))

    def reference(self, task, items, state):
        item = super().reference(task, items, state)
        if isinstance(item, Message):  # answers from the task, not from the state
            return Message(
                role="assistant", content=str(task.data["start"] + sum(task.data["numbers"]))
            )
        return item


class RandomCounter(CounterEnv):
    def verify(self, task, trajectory, state):
        verdict = super().verify(task, trajectory, state)
        return Verdict(reward=verdict.reward, components={"noise": random.random()})


class OffByOneReference(CounterEnv):
    def reference(self, task, items, state):
        item = super().reference(task, items, state)
        return Message(role="assistant", content="0") if isinstance(item, Message) else item


def check(report: AuditReport, name: str):
    return next(c for c in report.checks if c.name == name)


@pytest.mark.parametrize("env", sorted(BUILTIN))
def test_builtin_environments_pass(env: str) -> None:
    report = run_audit(env, samples=11, seed=4)
    assert report.passed, report
    assert check(report, "cheats").cases >= 11 * 10
    msgspec.json.decode(msgspec.json.encode(report), type=AuditReport)  # JSON-able


def test_a_lenient_verifier_fails_the_cheat_check() -> None:
    report = run_audit(f"{__name__}:LenientCounter", samples=4)
    cheats = check(report, "cheats")
    assert not report.passed and not cheats.passed
    assert cheats.worst.reward == 1.0 and cheats.worst.case.startswith("text:")
    assert check(report, "reference").passed


def test_wrong_typed_tool_calls_must_not_pay() -> None:
    report = run_audit(f"{__name__}:SloppyToolCounter", samples=3)
    assert check(report, "cheats").worst.case.startswith("tool_args:")
    assert not check(report, "cheats").passed


def test_a_random_verifier_fails_the_determinism_check() -> None:
    report = run_audit(f"{__name__}:RandomCounter", samples=2)
    assert not check(report, "determinism").passed
    assert check(report, "reference").passed


def test_a_wrong_reference_fails_the_reference_check() -> None:
    report = run_audit(f"{__name__}:OffByOneReference", samples=2)
    assert not check(report, "reference").passed
    assert check(report, "reference").worst.reward == 0.0


def test_play_bounds_the_turns() -> None:
    env = make_env("counter", steps=50)
    task = make_task(env, seed=0, index=0)
    trajectory = play(env, task, env.reference, max_turns=5)
    assert trajectory.status == "truncated" and len(trajectory.turns) == 5


def test_cli_exit_codes_and_json() -> None:
    runner = CliRunner()
    ok = runner.invoke(audit_command, ["--env", "counter", "--samples", "3", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["passed"] is True
    bad = runner.invoke(audit_command, ["--env", f"{__name__}:LenientCounter", "--samples", "2"])
    assert bad.exit_code == 1 and "FAIL cheats" in bad.output
    options = runner.invoke(
        audit_command, ["--env", "countdown", "--samples", "2", "-o", "count=3"]
    )
    assert options.exit_code == 0 and "PASS" in options.output
    unknown = runner.invoke(audit_command, ["--env", "nope"])
    assert unknown.exit_code == 2 and "unknown environment" in unknown.output
