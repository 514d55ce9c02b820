"""The agent loop of one episode, shared by the rollout workers and local evaluation.

    send the conversation to the policy
    -> function calls: run each against the environment, append function_call_output items
    -> plain answer: the environment may reply (games, simulated users) or end the episode
    stop on a final answer, ``max_turns`` or the token budget.

After every turn that does not end the episode, ``commit`` checkpoints the session; the final
turn is written together with the trajectory by the caller. A resumed session continues from
its last committed turn.

An environment whose state lives on a server (``envs.external.ExternalSessionEnv``) is also
checkpointed inside a turn, through its journal: its session is opened and checkpointed before
the first model turn, and each tool call is checkpointed before it is sent and after its answer.
Such an episode is resumed by the journal first (``aready``), then by sending the last turn's
calls that have no output yet.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from streamrl.config import RolloutConfig
from streamrl.envs.base import Environment, StepResult
from streamrl.envs.external import ExternalSessionEnv
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    Message,
    Session,
    Task,
    Trajectory,
    TrajectoryStatus,
)

Commit = Callable[[Session], Awaitable[bool]]
Save = Callable[[object], Awaitable[None]]


class LostClaim(Exception):
    """Another worker took this episode over; stop without writing anything."""


def new_session(env: Environment, task: Task) -> Session:
    state = env.reset(task)
    return Session(
        task_id=task.task_id,
        items=list(task.input),
        state=env.encode_state(state),
        started_at=time.time(),
    )


async def anew_session(env: Environment, task: Task) -> Session:
    """``new_session`` through the environment's async reset (a service may seed a session)."""
    state = await env.areset(task)
    return Session(
        task_id=task.task_id,
        items=list(task.input),
        state=env.encode_state(state),
        started_at=time.time(),
    )


def _checkpointer(env: Environment, session: Session, task: Task, commit: Commit | None) -> Save:
    """Checkpoint ``state`` with the session as it stands (an external environment's journal
    entries); a worker that lost its claim stops before its next request."""

    async def save(state: object) -> None:
        session.state = env.encode_state(state)
        if commit is not None and not await commit(session):
            raise LostClaim(task.task_id)

    return save


async def _no_checkpoint(state: object) -> None:
    return None


async def _call(
    env: Environment, task: Task, state: object, call: FunctionCall, session: Session, save: Save
) -> StepResult:
    """One tool call; an external environment's is written ahead through ``save``."""
    if isinstance(env, ExternalSessionEnv):
        return await env.acall_durably(task, state, call, session.items, save)
    return await env.acall_tool(task, state, call)


def _unanswered(session: Session) -> list[FunctionCall]:
    """The last model turn's calls that have no output yet (a worker died between them)."""
    if not session.turns:
        return []
    answered = set()
    for item in reversed(session.items):
        if not isinstance(item, FunctionCallOutput):
            break
        answered.add(item.call_id)
    last = session.turns[-1].items
    return [i for i in last if isinstance(i, FunctionCall) and i.call_id not in answered]


def _final_text(items: list) -> str | None:
    for item in reversed(items):
        if isinstance(item, Message) and item.role == "assistant":
            return item.content
    return None


async def run_served(
    env: Environment, endpoint: object, task: Task, session: Session, commit: Commit | None,
    worker: str = "",
) -> Trajectory:  # fmt: skip
    """An episode that an environment server drives (``serves_episodes``): its agent calls the
    worker's policy ``endpoint``, which records the model turns; the environment checkpoints
    each attempt before it starts, so a resumed session redoes the episode as its next attempt
    (the turns of a dead attempt are dropped with it)."""
    if endpoint is None:
        raise RuntimeError(
            f"environment {env.name!r} drives its own episodes (mode=run): it needs the rollout "
            "worker's policy endpoint"
        )
    if session.turns:  # a dead attempt's turns: that attempt is redone from the start
        session.turns, session.items, session.tokens = [], list(task.input), 0
    save = _checkpointer(env, session, task, commit)
    served = await env.arun_served(task, env.decode_state(session.state), endpoint, save)
    for turn in served.turns:
        turn.worker = worker
    session.items, session.turns = served.items, served.turns
    session.tokens = sum(len(t.token_ids) for t in served.turns)
    session.state = env.encode_state(served.state)
    return finish(task, session, "completed", worker=worker)


async def run_episode(
    env: Environment,
    policy: Policy,
    task: Task,
    session: Session,
    commit: Commit | None,
    config: RolloutConfig,
    worker: str = "",
    endpoint: object = None,
) -> Trajectory:
    if getattr(env, "serves_episodes", False):
        return await run_served(env, endpoint, task, session, commit, worker)
    state = env.decode_state(session.state)
    tools = env.tools_for(task)
    save, ended = _no_checkpoint, False
    if isinstance(env, ExternalSessionEnv):
        save = _checkpointer(env, session, task, commit)
        state = await env.aready(task, state, session.items, save)
        for call in _unanswered(session):
            result = await _call(env, task, state, call, session, save)
            state = result.state
            session.items.append(FunctionCallOutput(call_id=call.call_id, output=result.output))
            if result.done:
                ended = True
                break
            await save(state)
        session.state = env.encode_state(state)
    status: TrajectoryStatus = "completed"
    while not ended:
        turn = len(session.turns)
        if turn >= config.max_turns or session.tokens >= config.max_tokens:
            status = "truncated"
            break
        t0 = time.perf_counter()
        request = PolicyRequest(
            task=task,
            items=session.items,
            tools=tools,
            state=state,
            turn=turn,
            previous=session.turns[-1] if session.turns else None,
        )
        try:
            model_turn = await policy.respond(request)
        except PolicyError:
            raise
        except Exception as e:  # whatever broke in the backend, it is not the model's answer
            raise PolicyError(f"{type(e).__name__}: {e}") from e
        model_turn.worker = worker
        model_turn.seconds = time.perf_counter() - t0
        session.turns.append(model_turn)
        session.items.extend(model_turn.items)
        session.tokens += len(model_turn.token_ids)

        calls = [i for i in model_turn.items if isinstance(i, FunctionCall)]
        done = False
        if calls:
            t1 = time.perf_counter()
            for call in calls:
                result = await _call(env, task, state, call, session, save)
                state = result.state
                session.items.append(FunctionCallOutput(call_id=call.call_id, output=result.output))
                if result.done:  # the environment ends the episode (an answer was submitted)
                    done = True
                    break
                await save(state)  # an external environment's confirmation of the call
            session.tool_seconds += time.perf_counter() - t1
        else:
            text = _final_text(model_turn.items) or ""
            reply = env.reply(state, text)
            state = reply.state
            if reply.message is not None:
                session.items.append(Message(role="user", content=reply.message))
            done = reply.done or reply.message is None
        session.state = env.encode_state(state)
        if done:
            break
        if commit is not None and not await commit(session):
            raise LostClaim(task.task_id)
    return finish(task, session, status, worker=worker)


def finish(
    task: Task,
    session: Session,
    status: TrajectoryStatus,
    worker: str = "",
    failure: str | None = None,
) -> Trajectory:
    return Trajectory(
        task_id=task.task_id,
        prompt_id=task.prompt_id,
        k=task.k,
        group_size=task.group_size,
        env=task.env,
        items=session.items,
        n_input=len(task.input),
        turns=session.turns,
        status=status,
        failure=failure,
        state=session.state,
        data=task.data,
        started_at=session.started_at,
        finished_at=time.time(),
        tool_seconds=session.tool_seconds,
        worker=worker,
        attempt=session.claims,
        resumed_from_turn=session.resumed_from_turn,
    )
