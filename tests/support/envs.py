"""Environments with deliberate faults, loaded by real worker processes as
``tests.support.envs:<Class>`` (the repository root is on their PYTHONPATH)."""

from __future__ import annotations

import time

from streamrl.envs.base import Verdict
from streamrl.envs.counter import CounterEnv, CounterState
from streamrl.schema import Task, Trajectory


class SlowVerifyCounter(CounterEnv):
    """Verification takes ``verify_sleep_s``: long enough to kill a verifier mid-batch."""

    name = "slow-verify-counter"

    class Options(CounterEnv.Options, kw_only=True):
        verify_sleep_s: float = 0.05

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        time.sleep(float(self.options.get("verify_sleep_s", 0.05)))
        return super().verify(task, trajectory, state)


class HangingVerifyCounter(CounterEnv):
    """The verifier hangs on every task whose start value is a multiple of 5."""

    name = "hanging-verify-counter"

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        if int(task.data["start"]) % 5 == 0:
            time.sleep(3600)
        return super().verify(task, trajectory, state)


class RaisingVerifyCounter(CounterEnv):
    """The verifier raises on every task whose start value is odd."""

    name = "raising-verify-counter"

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        if int(task.data["start"]) % 2 == 1:
            raise ZeroDivisionError("verifier bug")
        return super().verify(task, trajectory, state)


class StrictCounter(CounterEnv):
    """A later verifier version that halves every reward."""

    name = "counter"
    verifier_name = "counter-strict"
    verifier_version = "2"

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        v = super().verify(task, trajectory, state)
        return Verdict(reward=v.reward * 0.5, components=v.components, details=v.details)


class BrokenInitEnv(CounterEnv):
    """An environment that crashes while it is built: a bug, not a bad option."""

    name = "broken-init"

    def __init__(self, **options: object) -> None:
        raise RuntimeError("this environment cannot start")


class EchoEnv(CounterEnv):
    """A deliberately hackable environment: the verifier rewards any answer that holds the
    secret word, and the prompt holds it, so restating the prompt scores full marks (the
    scripted policy's reference answer does exactly that). The restate tripwire's target."""

    name = "echo"
    tools = []

    def generate(self, rng, index):
        from streamrl.envs.base import Prompt, user

        word = rng.choice(["apple", "river", "stone", "cloud", "ember", "maple"])
        text = f"The secret word is {word}. Say only the secret word, nothing else."
        return Prompt([user(text)], {"start": 0, "target": 0, "word": word})

    def reset(self, task: Task) -> CounterState:
        return CounterState(value=0)

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        from streamrl.envs.base import last_assistant_text

        hit = task.data["word"] in last_assistant_text(trajectory.items)
        return Verdict(reward=float(hit))

    def reference(self, task, items, state):
        from streamrl.schema import Message

        prompt = " ".join(i.content for i in task.input if isinstance(i, Message))
        return Message(role="assistant", content=prompt)  # the hack: echo the prompt


class ShortcutCounter(CounterEnv):
    """A deliberately hackable counter, the collapse tripwire's target: its verifier checks
    only the final value, not the tool calls. Before prompt ``leak_from`` the reference agent
    does the work with the tool and slips on every second sample (k = 1 answers one too many);
    from ``leak_from`` on the prompt leaks the answer and the agent replies with it at once.
    So, as a policy that found the shortcut would, reward rises while tool use collapses."""

    name = "shortcut-counter"

    class Options(CounterEnv.Options, kw_only=True):
        leak_from: int = 1_000_000

    def generate(self, rng, index):
        from streamrl.envs.base import Prompt, user

        prompt = super().generate(rng, index)
        if index < int(self.options.get("leak_from", 1_000_000)):
            return prompt
        answer = prompt.data["start"] + sum(prompt.data["numbers"])
        text = f"{prompt.input[0].content} (The final value is {answer}.)"
        return Prompt([user(text)], {**prompt.data, "leaked": True})

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        v = super().verify(task, trajectory, state)
        return Verdict(reward=v.components["answer"], components=v.components, details=v.details)

    def reference(self, task, items, state):
        from streamrl.schema import Message

        expected = int(task.data["start"]) + sum(task.data["numbers"])
        if task.data.get("leaked"):
            return Message(role="assistant", content=str(expected))
        item = super().reference(task, items, state)
        if isinstance(item, Message) and task.k == 1:
            return Message(role="assistant", content=str(expected + 1))  # a slip
        return item
