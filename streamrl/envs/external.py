"""Exactly once against a stateful server: the write-ahead journal that every environment
whose episode lives in a session on an external server shares (``nemo-gym`` now).

The server applies each tool call to a session it holds, and the rollout worker may die at any
moment. A tool call sent again after a crash would be applied twice (a withdrawal made twice,
a counter incremented twice) and the episode would record the repeat's answer. So the journal,
part of the environment's state and checkpointed with the episode's Redis session, records
every request that may change the server before it is sent:

- **open**: "opening session *n*" is checkpointed, then the open request (NeMo Gym's
  ``/seed_session``) is sent, then the session's handle (cookies) is checkpointed, all before
  the first model turn;
- **a tool call**: its ``call_id`` is checkpointed as ``sending`` (with the model turn that made
  it), then the call is sent, then its output and the count of ``applied`` calls are
  checkpointed together.

A resumed episode (another worker took it over) reads the journal before anything else
(``aready``):

- an open not confirmed: its answer was lost with the worker. Where the open named the session
  by an id the caller chose (NeMo Gym 0.7's typed seed), it is closed by that id
  (``aclose_unconfirmed``, counted in ``closed``); otherwise that session, if the server made
  one, cannot be found (counted in ``lost``). A fresh session is opened (``attempt`` + 1);
- a call sent but not confirmed: it may or may not have been applied, and there is no asking
  the server which. It is never sent again in that session: the session is closed where the
  protocol allows (``closed``/``unclosed``), a fresh one is opened (``attempt`` + 1) and the
  episode's confirmed calls are replayed into it in order; a replayed call whose output differs
  from the recorded one means the server cannot reproduce the episode, and the sample is
  dropped as an infrastructure failure (``ReplayDiverged``, an ``EnvUnavailable``: a dead
  letter, never a reward). With ``replay`` off, an unconfirmed call drops the sample at once
  (for tools whose effects reach outside the session, where a replay would repeat them);
- a replay cut short carries on from ``applied``;
- then the calls of the last model turn that have no output yet are sent (by the episode loop).

A request whose answer is lost while the worker lives (a read timeout, a connection reset after
sending: ``CallUnconfirmed``) is recovered the same way, at most ``recoveries`` times. A
session the episode gives up on (a dead letter) is closed where the protocol allows.

``attempt`` counts the server sessions of the episode from 0, as NeMo Gym's ``EpisodeId``
counts the physical attempts of one rollout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
import structlog

from streamrl.envs._failpoints import failpoint
from streamrl.envs.base import Environment, EnvUnavailable, StepResult
from streamrl.schema import TASK, FunctionCall, FunctionCallOutput, Item, Task
from streamrl.session_codec import SESSION

__all__ = [
    "CallUnconfirmed",
    "ExternalSessionEnv",
    "ExternalState",
    "Journal",
    "ReplayDiverged",
    "abandon",
    "confirmed_calls",
]

log = structlog.get_logger("streamrl.envs.external")

S = TypeVar("S", bound="ExternalState")
Save = Callable[[Any], Awaitable[None]]


class Journal(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the server may have been asked, checkpointed before it is asked."""

    attempt: int = 0  # the episode's current server session, counted from 0
    phase: Literal["new", "opening", "open"] = "new"
    applied: int = 0  # the episode's confirmed calls applied in this session (-1: unknown)
    sending: str | None = None  # the call_id sent (or about to be) and not yet confirmed
    lost: int = 0  # sessions whose open was never confirmed: no handle to close them by
    closed: int = 0  # sessions given up and closed
    unclosed: int = 0  # sessions given up that the server would not close


class ExternalState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The base of an external environment's state: its journal, then the protocol's handle."""

    journal: Journal = msgspec.field(default_factory=Journal)


class CallUnconfirmed(EnvUnavailable):
    """A request reached the server, or may have, and its answer was lost (a read timeout, a
    connection reset after sending): whether it was applied is unknown."""


class ReplayDiverged(EnvUnavailable):
    """A confirmed call replayed into a fresh session answered differently: the server cannot
    reproduce the episode, so the sample is dropped."""


def confirmed_calls(items: list[Item]) -> list[tuple[FunctionCall, str]]:
    """The episode's calls that have an output, in the order they were applied."""
    latest: dict[str, FunctionCall] = {}
    out = []
    for item in items:
        if isinstance(item, FunctionCall):
            latest[item.call_id] = item
        elif isinstance(item, FunctionCallOutput):
            call = latest.pop(item.call_id, None)
            if call is not None:
                out.append((call, item.output))
    return out


async def abandon(env_for: Callable[[str], Environment], task: bytes, session: bytes) -> None:
    """Close the server session checkpointed in a task's Redis session (``session``, encoded)
    when its environment keeps one: a task dead-lettered before its episode could resume.
    Best effort: a session left open is a leak, not a wrong reward."""
    if not session:
        return
    try:
        decoded = TASK.decode(task)
        env = env_for(decoded.env)
        if isinstance(env, ExternalSessionEnv):
            await env.aabandon(decoded, env.decode_state(SESSION.state(session, task)))
    except Exception as e:  # nothing to close in what cannot be read
        log.warning("could not close a server session", error=repr(e))


async def _no_save(state: Any) -> None:
    return None


def _j(state: S, **changes: Any) -> S:
    journal = msgspec.structs.replace(state.journal, **changes)
    return msgspec.structs.replace(state, journal=journal)


class ExternalSessionEnv(Environment[S]):
    """An environment whose episode state lives in a session on a server. Subclasses speak the
    protocol (``aopen``, ``asend``, ``aclose_session``); this class keeps the journal."""

    replay: bool = True  # False: an unconfirmed call drops the sample instead of a replay
    recoveries: int = 3  # fresh sessions one lost answer may cost while the worker lives

    # ---------------------------------------------------------------- the protocol
    async def aopen(self, task: Task, state: S) -> S:
        """Open session ``state.journal.attempt`` on the server (no handle is carried over);
        the state with the new session's handle."""
        raise NotImplementedError

    async def asend(self, task: Task, state: S, call: FunctionCall) -> StepResult:
        """Send one call in the open session; ``CallUnconfirmed`` when its answer was lost."""
        raise NotImplementedError

    async def aclose_session(self, task: Task, state: S) -> bool:
        """Close the open session (idempotent); False when the server cannot close one."""
        return False

    async def aclose_unconfirmed(self, task: Task, state: S) -> bool:
        """Close session ``state.journal.attempt``, whose open was sent and never confirmed, by
        the id the caller gave it (a protocol whose open takes one); False when there is none
        (never raises: it is then counted as ``lost``)."""
        return False

    # ---------------------------------------------------------------- without a journal
    async def areset(self, task: Task) -> S:
        """An unopened state: the episode loop opens the session under the journal."""
        return self.reset(task)

    async def acall_tool(self, task: Task, state: S, call: FunctionCall) -> StepResult:
        """One call with nothing checkpointed (re-verification replays, local tools)."""
        if state.journal.phase != "open":
            state = await self._open(task, state, _no_save)
        return await self.asend(task, state, call)

    # ---------------------------------------------------------------- under the journal
    async def aready(self, task: Task, state: S, items: list[Item], save: Save) -> S:
        """The state with its session open and holding exactly the confirmed calls of
        ``items``; ``save`` checkpoints a state (the episode's commit)."""
        j = state.journal
        done = confirmed_calls(items)
        if j.phase == "new":
            return await self._open(task, state, save)
        if j.phase == "opening":
            if await self.aclose_unconfirmed(task, state):
                state = _j(state, closed=j.closed + 1, attempt=j.attempt + 1)
            else:
                log.warning(
                    "a session open was not confirmed: that session cannot be found",
                    task_id=task.task_id,
                    attempt=j.attempt,
                )
                state = _j(state, lost=j.lost + 1, attempt=j.attempt + 1)
            return await self._replay(task, state, done, save, fresh=True)
        if j.sending is not None:
            why = f"call {j.sending} was sent and not confirmed"
            return await self._recover(task, state, done, save, why)
        if j.applied < 0:  # a session checkpointed before the journal: trust it as it is
            return _j(state, applied=len(done))
        if j.applied < len(done):  # a replay cut short
            return await self._replay(task, state, done, save)
        return state

    async def acall_durably(
        self, task: Task, state: S, call: FunctionCall, items: list[Item], save: Save
    ) -> StepResult:
        """Send ``call``, written ahead; the caller appends its output and checkpoints that
        (the confirmation). A lost answer costs a fresh session and a replay."""
        for n in range(self.recoveries + 1):
            state = _j(state, sending=call.call_id)
            await save(state)
            try:
                result = await self.asend(task, state, call)
            except CallUnconfirmed as e:
                if n == self.recoveries:
                    await self.aabandon(task, state)
                    raise
                state = await self._recover(task, state, confirmed_calls(items), save, str(e))
                continue
            except EnvUnavailable:
                await self.aabandon(task, state)
                raise
            failpoint("after_tool_send", self._key(task, state, call.call_id))
            j = result.state.journal
            return result._replace(state=_j(result.state, sending=None, applied=j.applied + 1))
        raise AssertionError("unreachable")

    async def aabandon(self, task: Task, state: S) -> S:
        """Close the session the episode gives up on, where the protocol allows (never
        raises: a session left open is a leak, not a wrong reward)."""
        j = state.journal
        if j.phase != "open":
            return state
        try:
            closed = await self.aclose_session(task, state)
        except EnvUnavailable as e:
            log.warning("closing a session failed", task_id=task.task_id, error=str(e))
            closed = False
        if closed:
            return _j(state, phase="new", closed=j.closed + 1)
        return _j(state, phase="new", unclosed=j.unclosed + 1)

    # ---------------------------------------------------------------- the steps
    async def _open(self, task: Task, state: S, save: Save) -> S:
        state = _j(state, phase="opening", applied=0, sending=None)
        await save(state)
        state = await self.aopen(task, state)
        failpoint("after_open", self._key(task, state, ""))
        state = _j(state, phase="open")
        await save(state)
        return state

    async def _recover(
        self, task: Task, state: S, done: list[tuple[FunctionCall, str]], save: Save, why: str
    ) -> S:
        """Give the session up and carry the episode on in a fresh one (see the module)."""
        state = await self.aabandon(task, state)
        if not self.replay:
            raise EnvUnavailable(f"{why}; replay is off, so the sample is dropped")
        log.warning("replaying into a fresh session", task_id=task.task_id, why=why)
        state = _j(state, attempt=state.journal.attempt + 1)
        return await self._replay(task, state, done, save, fresh=True)

    async def _replay(
        self,
        task: Task,
        state: S,
        done: list[tuple[FunctionCall, str]],
        save: Save,
        fresh: bool = False,
    ) -> S:
        """Open session ``attempt`` (``fresh``) and replay into it the confirmed calls it does
        not hold yet, each written ahead. A lost answer on the way costs another fresh session,
        at most ``recoveries`` times; a session given up on is closed."""
        lost_answers = 0
        while True:
            try:
                if fresh:
                    state = await self._open(task, state, save)
                for call, recorded in done[state.journal.applied :]:
                    state = _j(state, sending=call.call_id)
                    await save(state)
                    result = await self.asend(task, state, call)
                    if result.output != recorded:
                        raise ReplayDiverged(
                            f"replaying call {call.call_id} ({call.name}) into a fresh session "
                            f"answered {result.output[:200]!r}, not the recorded "
                            f"{recorded[:200]!r}: the server cannot reproduce this episode"
                        )
                    state = _j(result.state, sending=None, applied=state.journal.applied + 1)
                    await save(state)
                return state
            except CallUnconfirmed:
                state = await self.aabandon(task, state)
                if lost_answers == self.recoveries:
                    raise
                lost_answers += 1
                state = _j(state, attempt=state.journal.attempt + 1)
                fresh = True
            except EnvUnavailable:
                await self.aabandon(task, state)
                raise

    @staticmethod
    def _key(task: Task, state: ExternalState, call_id: str) -> str:
        j = state.journal
        return f"{task.task_id}/{j.attempt}/{j.applied}/{call_id}"
