"""``streamrl audit``: does an environment's verifier reward what it should, and only that?

For a sample of generated tasks the audit plays scripted agents through the rollout workers'
episode loop (``play.play``; the cheating agents are in ``cheats``) and checks:

- ``generate``: the same seed and index give the same task, and the task survives msgpack.
- ``reference``: the reference agent (``Environment.reference``) completes and scores
  ``env.max_reward``.
- ``wrong``: the wrong agent (``Environment.wrong``) scores below the maximum; its reward is the
  baseline of the next check.
- ``cheats``: no cheating answer scores more than the wrong agent on the same task. The cheats
  are the wrong agent's trajectory with every assistant message swapped for: nothing, blanks,
  the prompt echoed, 100k characters, every candidate answer at once, or malformed markup; and
  the reference agent with every tool call's arguments of the wrong JSON type.
- ``determinism``: verifying a trajectory again, after a msgpack round trip of the trajectory
  and its state, and with a fresh environment instance, gives the same reward and components.

An environment needs nothing beyond the ``Environment`` API for this; ``wrong`` has a default
that perturbs the reference's final answer, which an environment overrides when a changed number
is not a wrong answer (state-based tasks, games, partial credit).
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

import msgspec

from streamrl.envs.base import Verdict, last_assistant_text
from streamrl.envs.registry import make_env
from streamrl.evaluation.cheats import break_tool_calls, cheat_texts, swap_messages
from streamrl.evaluation.play import DEFAULT_MAX_TURNS, Agent, make_task, play, verify
from streamrl.schema import TRAJECTORY, FunctionCall, Task, Trajectory, encode

DEFAULT_SAMPLES = 20
_EPS = 1e-9

_Played = tuple[Trajectory, Verdict]


# ---------------------------------------------------------------- the report


class Finding(msgspec.Struct, kw_only=True):
    task_id: str
    case: str
    reward: float | None  # None: the verifier (or the episode) raised
    limit: float | None = None  # the bound the reward was held to
    detail: str = ""


class CheckReport(msgspec.Struct, kw_only=True):
    name: str
    passed: bool
    cases: int
    failures: int
    worst: Finding | None = None  # the case closest to failing, or the worst failure


class AuditReport(msgspec.Struct, kw_only=True):
    env: str
    env_version: str
    verifier: str
    verifier_version: str
    seed: int
    samples: int
    max_reward: float
    options: dict[str, Any]
    checks: list[CheckReport]
    passed: bool
    seconds: float


class _Check:
    """Collects the cases of one check, keeping the worst (highest ``badness``)."""

    def __init__(self, name: str) -> None:
        self.name, self.cases, self.failures = name, 0, 0
        self.worst: tuple[float, Finding] | None = None

    def add(self, finding: Finding, badness: float, failed: bool) -> None:
        self.cases += 1
        self.failures += failed
        badness = math.inf if failed and not badness > 0 else badness
        if self.worst is None or badness > self.worst[0]:
            self.worst = (badness, finding)

    def report(self) -> CheckReport:
        worst = self.worst[1] if self.worst else None
        return CheckReport(
            name=self.name,
            passed=self.failures == 0,
            cases=self.cases,
            failures=self.failures,
            worst=worst,
        )


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
    return f"{type(e).__name__}: {e}"[:300] + at


def _reward_ok(reward: float) -> bool:
    return isinstance(reward, (int, float)) and math.isfinite(reward)


class _Audit:
    def __init__(self, env_name: str, seed: int, options: dict[str, Any], max_turns: int):
        self.env_name, self.seed, self.options, self.max_turns = env_name, seed, options, max_turns
        self.env = make_env(env_name, **options)
        self.checks = {
            n: _Check(n) for n in ("generate", "reference", "wrong", "cheats", "determinism")
        }

    def run_task(self, index: int) -> None:
        """The checks on task ``index``, in order: each needs what the one before it played."""
        task = self._generate(index)
        if task is None:
            return
        ref = self._reference(task)
        if ref is None:
            return
        wrong = self._wrong(task)
        if wrong is None:
            return
        played = [ref, wrong, *self._cheats(task, ref, wrong)]
        for trajectory, verdict in played:
            self._determinism(task, trajectory, verdict)

    def _generate(self, index: int) -> Task | None:
        env, check = self.env, self.checks["generate"]
        try:
            task = make_task(env, self.seed, index)
            same = encode(make_task(env, self.seed, index)) == encode(task)
        except Exception as e:
            tid = f"{env.name}-{self.seed}-{index}:0"
            check.add(
                Finding(task_id=tid, case="generate", reward=None, detail=_error(e)), 0.0, True
            )
            return None
        detail = "" if same else "the same seed and index gave a different task"
        check.add(
            Finding(task_id=task.task_id, case="generate", reward=None, detail=detail),
            0.0,
            not same,
        )
        return task

    def _reference(self, task: Task) -> _Played | None:
        env, check = self.env, self.checks["reference"]
        ref = self._episode(task, "reference", env.reference, check)
        if ref is None:
            return None
        r = ref[1].reward
        failed = ref[0].status != "completed" or abs(r - env.max_reward) > _EPS
        detail = f"status {ref[0].status}; {ref[1].details}"
        check.add(
            Finding(
                task_id=task.task_id,
                case="reference",
                reward=r,
                limit=env.max_reward,
                detail=detail,
            ),
            env.max_reward - r,
            failed,
        )
        return ref

    def _wrong(self, task: Task) -> _Played | None:
        env, check = self.env, self.checks["wrong"]
        wrong = self._episode(task, "wrong", env.wrong, check)
        if wrong is None:
            return None
        w = wrong[1].reward
        check.add(
            Finding(
                task_id=task.task_id,
                case="wrong",
                reward=w,
                limit=env.max_reward,
                detail=str(wrong[1].details),
            ),
            w,
            w >= env.max_reward - _EPS,
        )
        return wrong

    def _cheats(self, task: Task, ref: _Played, wrong: _Played) -> list[_Played]:
        """Each cheat held to the wrong agent's reward ``w``; returns what was played."""
        env, check, w = self.env, self.checks["cheats"], wrong[1].reward
        cheats: dict[str, Agent] = {
            f"text:{name}": swap_messages(env.wrong, text)
            for name, text in cheat_texts(
                task, last_assistant_text(ref[0].items), last_assistant_text(wrong[0].items)
            ).items()
        }
        if any(isinstance(i, FunctionCall) for i in ref[0].items):
            for how in ("types", "string"):
                cheats[f"tool_args:{how}"] = break_tool_calls(env, env.reference, how)
        played = []
        for case, agent in cheats.items():
            got = self._episode(task, case, agent, check)
            if got is None:
                continue
            c = got[1].reward
            detail = str(got[1].details)[:300]
            check.add(
                Finding(task_id=task.task_id, case=case, reward=c, limit=w, detail=detail),
                c - w,
                c > w + _EPS,
            )
            played.append(got)
        return played

    def _episode(self, task: Task, case: str, agent: Agent, check: _Check) -> _Played | None:
        """Play and verify; a crash or a non-finite reward is a failure of ``check``."""
        try:
            trajectory = play(self.env, task, agent, self.max_turns)
            verdict = verify(self.env, task, trajectory)
            if not _reward_ok(verdict.reward):
                raise ValueError(f"reward {verdict.reward!r} is not a finite number")
        except Exception as e:
            check.add(
                Finding(task_id=task.task_id, case=case, reward=None, detail=_error(e)),
                math.inf,
                True,
            )
            return None
        return trajectory, verdict

    def _determinism(self, task: Task, trajectory: Trajectory, first: Verdict) -> None:
        case = "again, round trip, fresh env"
        try:
            again = verify(self.env, task, trajectory)
            copy = TRAJECTORY.decode(encode(trajectory))
            fresh = make_env(self.env_name, **self.options)
            state = fresh.decode_state(copy.state)
            restate = fresh.encode_state(state)
            tripped = fresh.verify(task, copy, fresh.decode_state(restate))
            verdicts = [first, again, tripped]
        except Exception as e:
            self.checks["determinism"].add(
                Finding(task_id=task.task_id, case=case, reward=None, detail=_error(e)),
                math.inf,
                True,
            )
            return
        keys = {(v.reward, tuple(sorted(v.components.items()))) for v in verdicts}
        same = len(keys) == 1 and restate == copy.state
        detail = (
            "" if same else f"verdicts {sorted(keys)}; state bytes stable: {restate == copy.state}"
        )
        self.checks["determinism"].add(
            Finding(task_id=task.task_id, case=case, reward=first.reward, detail=detail),
            0.0 if same else 1.0,
            not same,
        )


def run_audit(
    env_name: str,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> AuditReport:
    """Audit ``samples`` generated tasks of ``env_name``; see the module docstring."""
    start = time.perf_counter()
    audit = _Audit(env_name, seed, dict(options or {}), max_turns)
    for index in range(samples):
        audit.run_task(index)
    checks = [c.report() for c in audit.checks.values()]
    name, version = audit.env.verifier_id
    return AuditReport(
        env=audit.env.name,
        env_version=audit.env.version,
        verifier=name,
        verifier_version=version,
        seed=seed,
        samples=samples,
        max_reward=audit.env.max_reward,
        options=audit.options,
        checks=checks,
        passed=all(c.passed for c in checks),
        seconds=round(time.perf_counter() - start, 3),
    )
