"""``chat``: the model answers a dataset's prompt once, with no tools; the run's reward
functions score it (``verifier = "module:function"``, see ``streamrl.verifiers.
reward_functions``). This is what a TRL GRPO script's dataset and reward functions become.

Options: ``reference``, the scripted policy's answer (and the audit's reference), a
``str.format`` template filled with the row's columns, e.g. ``"\\\\boxed{{{ground_truth}}}"``
(literal braces doubled). Empty: the scripted policy answers with an empty message.
"""

from __future__ import annotations

import msgspec

from streamrl.envs.base import Environment, Verdict
from streamrl.schema import Item, Message, Task, Trajectory


class ChatState(msgspec.Struct):
    pass


class NoVerifier(RuntimeError):
    """A chat run without reward functions: nothing can score it."""


class ChatEnv(Environment[ChatState]):
    name = "chat"
    version = "1"
    State = ChatState
    tools = []

    class Options(msgspec.Struct, kw_only=True):
        reference: str = ""

    def reset(self, task: Task) -> ChatState:
        return ChatState()

    def verify(self, task: Task, trajectory: Trajectory, state: ChatState) -> Verdict:
        raise NoVerifier(
            "environment 'chat' has no verifier of its own: set verifier = "
            '"module:function" (TRL-style reward functions) in the run config'
        )

    def reference(self, task: Task, items: list[Item], state: ChatState) -> Item:
        template = str(self.options.get("reference", ""))
        try:
            text = template.format(**task.data)
        except (KeyError, IndexError, ValueError) as e:
            text = f"(reference template {template!r} does not fit the row: {e})"
        return Message(role="assistant", content=text)
