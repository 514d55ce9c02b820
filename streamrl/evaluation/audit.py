"""``streamrl audit``: does an environment's verifier reward what it should, and only that?

For a sample of generated tasks the audit plays scripted agents through a small local episode
loop (``play``) and checks:

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

import asyncio
import json
import math
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from streamrl.config import RolloutConfig
from streamrl.envs.base import Environment, Verdict
from streamrl.envs.registry import make_env
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.schema import (
    TASK,
    TRAJECTORY,
    FunctionCall,
    Item,
    Message,
    ModelTurn,
    Task,
    Trajectory,
    encode,
)
from streamrl.workers.episode import new_session, run_episode

Agent = Callable[[Task, list[Item], Any], Item]

DEFAULT_SAMPLES = 20
DEFAULT_MAX_TURNS = 32
LONG_CHARS = 100_000
EPS = 1e-9


# ---------------------------------------------------------------- a local episode loop


class AgentPolicy(Policy):
    """An agent function as a policy backend, so the audit runs the workers' own loop."""

    name = "agent"

    def __init__(self, agent: Agent):
        self.agent = agent

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        item = self.agent(request.task, request.items, request.state)
        return ModelTurn(index=request.turn, items=[item])


def play(
    env: Environment, task: Task, agent: Agent, max_turns: int = DEFAULT_MAX_TURNS
) -> Trajectory:
    """Run one episode through the rollout workers' episode loop (no Redis, no commits)."""
    config = RolloutConfig(max_turns=max_turns)
    session = new_session(env, task)
    return asyncio.run(run_episode(env, AgentPolicy(agent), task, session, None, config))


def make_task(env: Environment, seed: int, index: int) -> Task:
    """Task ``index`` of the env's generator under ``seed``, after a msgpack round trip (so
    data that would not survive Redis fails here)."""
    prompt = env.generate(random.Random(f"{seed}:{index}"), index)
    prompt_id = f"{env.name}-{seed}-{index}"
    task = Task(
        task_id=f"{prompt_id}:0",
        prompt_id=prompt_id,
        k=0,
        group_size=1,
        env=env.name,
        input=list(prompt.input),
        data=dict(prompt.data),
        seed=seed,
    )
    return TASK.decode(encode(task))


def verify(env: Environment, task: Task, trajectory: Trajectory) -> Verdict:
    """Score as the verifier worker does: from the trajectory's encoded state only."""
    return env.verify(task, trajectory, env.decode_state(trajectory.state))


# ---------------------------------------------------------------- the cheats


def final_text(trajectory: Trajectory) -> str:
    for item in reversed(trajectory.items):
        if isinstance(item, Message) and item.role == "assistant":
            return item.content
    return ""


def cheat_texts(task: Task, reference: str, wrong: str) -> dict[str, str]:
    """Final answers that must not beat a wrong answer. ``reference`` is the correct answer's
    text: a cheat that buries it among others, or breaks its markup, must not get credit."""
    prompt = "\n".join(i.content for i in task.input if isinstance(i, Message))
    unit = f"{prompt}\n{reference}\n{wrong}\n"
    tail = "\nI am not sure."
    long = (unit * (LONG_CHARS // max(1, len(unit)) + 1))[: LONG_CHARS - len(tail)] + tail
    texts = {
        "empty": "",
        "blank": " \n\t ",
        "echo_prompt": prompt,
        "long_100k": long,
        "both_answers": f"{wrong}\n{reference}",
        "number_spray": " ".join(str(i) for i in range(-100, 1001)),
        "boxed_spray": " ".join(f"\\boxed{{{i}}}" for i in range(0, 1001)) + " " + reference,
        "tag_spray": "".join(f"<answer>{i}</answer>" for i in range(0, 201)) + reference,
        "malformed_open": "\\boxed{\\frac{" + "{" * 50 + "<answer>",
        "malformed_empty": "\\boxed{} <answer></answer> Answer:",
    }
    unclosed = reference.translate(str.maketrans("", "", "})>]"))
    if unclosed != reference:
        texts["malformed_unclosed"] = unclosed
    doubled = reference.replace("{", "{{").replace("<", "<<")
    if doubled != reference:
        texts["malformed_doubled"] = doubled
    return texts


def swap_messages(agent: Agent, text: str) -> Agent:
    """``agent``, except that every assistant message it would send is ``text``."""

    def cheat(task: Task, items: list[Item], state: Any) -> Item:
        item = agent(task, items, state)
        if isinstance(item, Message):
            return Message(role="assistant", content=text)
        return item

    return cheat


_RETYPE: dict[str, Callable[[Any], Any]] = {
    "integer": str,
    "number": str,
    "string": lambda v: [v],
    "boolean": lambda v: "true" if v else "false",
    "array": json.dumps,
    "object": json.dumps,
}


def break_arguments(env: Environment, call: FunctionCall, how: str) -> FunctionCall:
    """``call`` with arguments of the wrong JSON type: each argument retyped (``how="types"``)
    or the whole object sent as a JSON string (``how="string"``)."""
    if how == "string":
        return msgspec.structs.replace(call, arguments=json.dumps(call.arguments))
    tool = next((t for t in env.tools if t.name == call.name), None)
    props = tool.parameters.get("properties", {}) if tool else {}
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call
    if not isinstance(args, dict):
        return call
    broken: Any = {}
    for key, value in args.items():
        kind = props.get(key, {}).get("type")
        broken[key] = _RETYPE[kind](value) if kind in _RETYPE else value
    if broken == args:
        broken = [args]  # nothing to retype: an array where an object is required
    return msgspec.structs.replace(call, arguments=json.dumps(broken))


def break_tool_calls(env: Environment, agent: Agent, how: str) -> Agent:
    def cheat(task: Task, items: list[Item], state: Any) -> Item:
        item = agent(task, items, state)
        return break_arguments(env, item, how) if isinstance(item, FunctionCall) else item

    return cheat


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
        env, checks = self.env, self.checks
        try:
            task = make_task(env, self.seed, index)
            same = encode(make_task(env, self.seed, index)) == encode(task)
        except Exception as e:
            tid = f"{env.name}-{self.seed}-{index}:0"
            checks["generate"].add(
                Finding(task_id=tid, case="generate", reward=None, detail=_error(e)), 0.0, True
            )
            return
        detail = "" if same else "the same seed and index gave a different task"
        checks["generate"].add(
            Finding(task_id=task.task_id, case="generate", reward=None, detail=detail),
            0.0,
            not same,
        )

        ref = self._episode(task, "reference", env.reference, checks["reference"])
        if ref is None:
            return
        r = ref[1].reward
        failed = ref[0].status != "completed" or abs(r - env.max_reward) > EPS
        detail = f"status {ref[0].status}; {ref[1].details}"
        checks["reference"].add(
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

        wrong = self._episode(task, "wrong", env.wrong, checks["wrong"])
        if wrong is None:
            return
        w = wrong[1].reward
        checks["wrong"].add(
            Finding(
                task_id=task.task_id,
                case="wrong",
                reward=w,
                limit=env.max_reward,
                detail=str(wrong[1].details),
            ),
            w,
            w >= env.max_reward - EPS,
        )

        played = [ref, wrong]
        cheats: dict[str, Agent] = {
            f"text:{name}": swap_messages(env.wrong, text)
            for name, text in cheat_texts(task, final_text(ref[0]), final_text(wrong[0])).items()
        }
        if any(isinstance(i, FunctionCall) for i in ref[0].items):
            for how in ("types", "string"):
                cheats[f"tool_args:{how}"] = break_tool_calls(env, env.reference, how)
        for case, agent in cheats.items():
            got = self._episode(task, case, agent, checks["cheats"])
            if got is None:
                continue
            c = got[1].reward
            detail = str(got[1].details)[:300]
            checks["cheats"].add(
                Finding(task_id=task.task_id, case=case, reward=c, limit=w, detail=detail),
                c - w,
                c > w + EPS,
            )
            played.append(got)

        for trajectory, verdict in played:
            self._determinism(task, trajectory, verdict)

    def _episode(
        self, task: Task, case: str, agent: Agent, check: _Check
    ) -> tuple[Trajectory, Verdict] | None:
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


def format_report(report: AuditReport) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"audit {report.env} v{report.env_version} (verifier {report.verifier} "
        f"v{report.verifier_version}), {report.samples} samples, seed {report.seed}, "
        f"max reward {report.max_reward:g}: {verdict} in {report.seconds:.2f}s"
    ]
    for c in report.checks:
        status = "PASS" if c.passed else "FAIL"
        line = f"  {status} {c.name:<12} {c.cases:>5} cases {c.failures:>4} failed"
        if c.worst is not None:
            w = c.worst
            line += f"  worst: {w.task_id} {w.case}"
            if w.reward is not None or w.detail:
                reward = "error" if w.reward is None else f"{w.reward:g}"
                line += f" reward {reward}"
            if w.limit is not None:
                line += f" (limit {w.limit:g})"
            if w.detail:
                line += f" - {w.detail[:160]}"
        lines.append(line)
    return "\n".join(lines)
