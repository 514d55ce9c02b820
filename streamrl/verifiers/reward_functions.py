"""TRL-style reward functions as a run's verifier: ``verifier = "module:function"`` (or a list,
weighted by ``reward_weights`` as TRL's ``GRPOConfig.reward_weights``), so that the reward
functions of a TRL (or Unsloth) GRPO script score streamrl's trajectories unchanged.

Each function is called the way TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls it, with
a batch of one sample:

    func(prompts=[prompt], completions=[completion], completion_ids=[ids],
         trainer_state=..., log_extra=..., log_metric=..., **{column: [value] for each column})

- ``prompts``/``completions`` in TRL's *standard* form (strings) when the row's prompt was a
  string, else *conversational* (lists of ``{"role", "content"}`` messages; a tool call is an
  assistant message with ``tool_calls``, its output a ``tool`` message).
- ``completion_ids``: the tokens the policy sampled, every turn's in order.
- the dataset's other columns (``Task.data``) as keyword arguments, each a list of one value.
- ``trainer_state``: a ``TrainerStateView`` whose ``global_step`` is the oldest policy version
  that sampled the trajectory (streamrl's learner steps and policy versions advance together).
- ``log_extra(column, values)`` / ``log_metric(name, value)``: what they are given is kept in
  ``Score.info`` (under ``log_extra`` / ``log_metric``).

As in TRL: an ``async def`` function is awaited; a ``None`` reward means "this function does
not apply here" and is left out of the weighted sum; a function must return one reward per
completion. Unlike TRL, a sample for which *every* function returned None is not trained on
with advantage 0 inside its group: it is a verifier failure (dead-lettered, its group
dropped), since a streamrl group has no place for an unscored sample. A function that raises
is a verifier failure too (retried, then dead-lettered), never a reward of 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from streamrl.config import JUDGE, RunConfig
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, Task, Trajectory
from streamrl.verifiers.judge import Judge
from streamrl.verifiers.verdict import Verdict

# Task.data marks a row whose prompt was a plain string: TRL's standard form. Never passed to
# the reward functions as a column.
STANDARD_PROMPT = "_trl_standard_prompt"
# Columns TRL never passes as keyword arguments (it passes them as prompts/completions).
_NOT_COLUMNS = {"prompt", "completion", "completion_ids", STANDARD_PROMPT}


class RewardFunctionError(ValueError):
    """A ``verifier`` spec that cannot be loaded, or weights that do not fit it."""


class Unscorable(ValueError):
    """Every reward function returned None for the sample."""


@dataclass
class TrainerStateView:
    """What a reward function may read of TRL's ``TrainerState``: the step is the policy
    version that sampled the trajectory; the rest is not known to a verifier worker."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)


def load_function(spec: str) -> Callable[..., Any]:
    """``module:function`` (importable from the current directory too, as rq does)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise RewardFunctionError(f"verifier {spec!r}: expected module:function")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RewardFunctionError(f"verifier {spec!r}: cannot import {module}: {e}") from e
    func = mod
    for part in attr.split("."):
        func = getattr(func, part, None)
        if func is None:
            raise RewardFunctionError(f"verifier {spec!r}: module {module} has no {attr!r}")
    if not callable(func):
        raise RewardFunctionError(f"verifier {spec!r} is not callable")
    return func  # type: ignore[return-value]


def _name(func: Callable[..., Any], spec: str) -> str:
    return getattr(func, "__name__", None) or spec


def _source_digest(funcs: list[Callable[..., Any]], weights: list[float], extra: str = "") -> str:
    """The verifier's version: a digest of the functions' source and the weights (and the
    judge's version), so that a changed function re-verifies stored trajectories into a drift
    report."""
    h = hashlib.sha256(repr(weights).encode() + extra.encode())
    for f in funcs:
        try:
            h.update(inspect.getsource(f).encode())
        except (OSError, TypeError):
            h.update(repr(f).encode())
    return h.hexdigest()[:12]


class RewardFunctions:
    """The run's reward functions, loaded once per verifier worker. The name ``judge`` among
    them is the run's LLM judge (``streamrl.verifiers.judge``), weighted like the others: a
    judge and a programmatic check combine as TRL's ``reward_weights`` combine functions."""

    def __init__(
        self, specs: list[str], weights: list[float] | None = None, judge: Judge | None = None
    ):
        if not specs:
            raise RewardFunctionError("verifier: give at least one module:function")
        weights = list(weights) if weights else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise RewardFunctionError(
                f"reward_weights has {len(weights)} values for {len(specs)} reward functions"
            )
        if JUDGE in specs and judge is None:
            raise RewardFunctionError('verifier "judge" needs the run\'s [judge] table')
        self.specs = list(specs)
        self.judge = judge
        self.funcs = [_judged if s == JUDGE else load_function(s) for s in specs]
        self.weights = [float(w) for w in weights]
        names = [_name(f, s) for f, s in zip(self.funcs, specs, strict=True)]
        # two functions of the same name (from different modules) keep their specs apart
        self.names = [s if names.count(n) > 1 else n for n, s in zip(names, specs, strict=True)]
        if self.specs == [JUDGE] and judge is not None:
            self.verifier_id = judge.verifier_id
        else:
            extra = judge.version if judge is not None else ""
            self.verifier_id = ("reward-functions", _source_digest(self.funcs, self.weights, extra))

    @classmethod
    def of_run(cls, cfg: RunConfig, r: redis.Redis | None = None) -> RewardFunctions:
        """The run's ``verifier`` list, its judge sharing pool and cache through ``r``."""
        judge = Judge(cfg.judge, r, cfg.run) if cfg.judge is not None else None
        return cls(cfg.reward_functions, cfg.reward_weights, judge)

    def score(self, task: Task, trajectory: Trajectory) -> Verdict:
        kwargs = trl_arguments(task, trajectory)
        extra: dict[str, Any] = {}
        metrics: dict[str, float] = {}
        kwargs["log_extra"] = lambda column, values: extra.__setitem__(column, values)
        kwargs["log_metric"] = lambda name, value: metrics.__setitem__(name, value)
        values: dict[str, float | None] = {}
        info: dict[str, Any] = {"reward_functions": values}
        for func, name in zip(self.funcs, self.names, strict=True):
            if func is _judged and self.judge is not None:
                values[name], info["judge"] = self.judge.score(task, trajectory)
            else:
                values[name] = _one_reward(func, name, kwargs)
        used = [(w, v) for w, v in zip(self.weights, values.values(), strict=True) if v is not None]
        if not used:
            raise Unscorable(f"every reward function returned None ({', '.join(self.names)})")
        if extra:
            info["log_extra"] = extra
        if metrics:
            info["log_metric"] = metrics
        return Verdict(
            reward=sum(w * v for w, v in used),
            components={n: v for n, v in values.items() if v is not None},
            info=info,
        )


def _judged(**kwargs: Any) -> list[float | None]:
    """Where the judge sits in the list of functions (``RewardFunctions.score`` asks the
    judge itself, with the task and the trajectory)."""
    raise AssertionError("the judge is called by RewardFunctions.score")


_judged.__name__ = JUDGE


def _one_reward(func: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> float | None:
    out = func(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    if not isinstance(out, list | tuple) or len(out) != 1:
        got = len(out) if isinstance(out, list | tuple) else type(out).__name__
        raise ValueError(
            f"reward function {name!r} returned {got} rewards for 1 completion "
            "(TRL expects a list with one reward per completion)"
        )
    value = out[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:  # numpy and torch scalars
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward function {name!r} returned {type(value).__name__}, not a number"
            ) from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function {name!r} returned {value}")
    return value


async def _awaited(aw: Any) -> Any:
    return await aw


def trl_arguments(task: Task, trajectory: Trajectory) -> dict[str, Any]:
    """The keyword arguments TRL's GRPOTrainer gives a reward function, for one sample."""
    episode = trajectory.items[trajectory.n_input :]
    if task.data.get(STANDARD_PROMPT):
        prompt: Any = "".join(m.content for m in task.input if isinstance(m, Message))
        completion: Any = "".join(
            m.content for m in episode if isinstance(m, Message) and m.role == "assistant"
        )
    else:
        prompt = _messages(task.input)
        completion = _messages(episode)
    ids = [t for turn in trajectory.turns for t in turn.token_ids]
    step = min(trajectory.policy_versions, default=0)
    kwargs: dict[str, Any] = {
        key: [value] for key, value in task.data.items() if key not in _NOT_COLUMNS
    }
    kwargs.update(
        prompts=[prompt],
        completions=[completion],
        completion_ids=[ids],
        trainer_state=TrainerStateView(global_step=step),
    )
    return kwargs


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses items as the chat messages TRL's conversational form uses."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, Message):
            out.append({"role": item.role, "content": item.content})
        elif isinstance(item, FunctionCall):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":  # the same turn's text and calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out
