"""The write-ahead journal of external sessions (streamrl/envs/external.py), driven through the
rollout workers' episode loop against the stateful test resources server in its own process.

A crash is a checkpoint that never lands: the commit raises at the chosen save, as a worker
killed just before it would, and another ``run_episode`` resumes from the last save that
landed. What the server did is read from its own log. (Real rq workers SIGKILLed at the same
points are in tests/workers/test_nemo_gym_exactly_once.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from streamrl import schema, session_codec
from streamrl.config import RolloutConfig
from streamrl.envs import EnvUnavailable, make_env
from streamrl.envs.external import ReplayDiverged, confirmed_calls
from streamrl.envs.nemo_gym import NemoGymEnv, NemoGymState
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.responses import row_to_prompt
from streamrl.schema import FunctionCall, FunctionCallOutput, ModelTurn, Session, Task
from streamrl.workers.episode import new_session, run_episode
from tests.support.nemo_gym import (
    COUNTER_TOOLS,
    TICKET_TOOL,
    counter_row,
    resources_server,
    sessions,
)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with resources_server(tmp_path_factory.mktemp("external-server")) as url:
        yield url


@pytest.fixture(scope="module")
def typed_url(tmp_path_factory):
    with resources_server(tmp_path_factory.mktemp("external-typed"), "typed") as url:
        yield url


class _Crash(BaseException):
    """The worker dies: nothing the episode loop or the environment catches."""


class _Reference(Policy):
    name = "reference"

    def __init__(self, env: NemoGymEnv) -> None:
        self.env = env

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        item = self.env.reference(request.task, request.items, request.state)
        return ModelTurn(index=request.turn, items=[item])


def _task(row: dict) -> Task:
    items, data, pid = row_to_prompt(json.dumps(row))
    return Task(task_id=f"{pid}:0", prompt_id=pid, k=0, group_size=1, env="nemo-gym",
                input=items, data=data)  # fmt: skip


Crash = Callable[[Session, NemoGymState], bool]


def _episode(env: NemoGymEnv, task: Task, crash: Crash | None, store: list[bytes]):
    """Run (or resume, from ``store``'s last checkpoint) an episode whose commits land in
    ``store`` until ``crash`` says this one does not."""
    if store:
        session = session_codec.SESSION.decode(store[-1])
        session.claims += 1
    else:
        session = new_session(env, task)

    async def commit(s: Session) -> bool:
        if crash is not None and crash(s, env.decode_state(s.state)):
            raise _Crash
        store.append(schema.encode(s))
        return True

    async def go():
        try:
            return await run_episode(env, _Reference(env), task, session, commit, RolloutConfig())
        finally:
            await env.aclose()

    return asyncio.run(go())


def _after_answer_of(call_id: str) -> Crash:
    """The checkpoint that confirms ``call_id``: it was applied, its answer is in hand."""

    def crash(s: Session, state: NemoGymState) -> bool:
        last = s.items[-1]
        return (
            isinstance(last, FunctionCallOutput)
            and last.call_id == call_id
            and (state.journal.sending is None)
        )

    return crash


def _server_calls(url: str, label: str) -> list[tuple[list[str], bool, int]]:
    """Each of the label's sessions, in the order they were opened: (calls, closed, verifies)."""
    rows = [r for r in sessions(url).values() if r["label"] == label]
    rows.sort(key=lambda r: r["seqs"][0] if r["seqs"] else 1 << 60)
    return [(r["calls"], r["closed"], r["verifies"]) for r in rows]


def _calls(traj: schema.Trajectory) -> list[str]:
    return [
        f"{c.name}:{json.loads(c.arguments)['count']}" if "count" in c.arguments else c.name
        for c, _ in confirmed_calls(traj.items)
    ]


def test_a_call_applied_but_not_checkpointed_is_replayed_into_a_fresh_session(server_url):
    env = make_env("nemo-gym", base_url=server_url)
    task = _task(counter_row("wal1", 10, [2, 3, 4]))
    store: list[bytes] = []
    with pytest.raises(_Crash):
        _episode(env, task, _after_answer_of("call_1"), store)
    traj = _episode(env, task, None, store)
    state = env.decode_state(traj.state)
    verdict = env.verify(task, traj, state)

    (old_calls, old_closed, old_verifies), (new_calls, new_closed, verifies) = _server_calls(
        server_url, "wal1"
    )
    # the first session applied call_1 and was closed, never verified
    assert old_calls == ["increment_counter:2", "increment_counter:3"] and old_closed
    assert old_verifies == 0
    # the second holds every call once: the confirmed call_0 replayed, then call_1 and call_2
    assert new_calls == _calls(traj) == ["increment_counter:2", "increment_counter:3",
                                         "increment_counter:4"]  # fmt: skip
    assert new_closed and verifies == 1 and verdict.reward == 1.0  # closed after /verify
    j = state.journal
    assert (j.attempt, j.closed, j.lost, j.applied, j.sending) == (1, 1, 0, 3, None)
    assert len(traj.turns) == 4  # the turn that made call_1 was not asked of the policy again


def test_a_seed_answered_but_not_checkpointed_opens_a_fresh_session(server_url):
    env = make_env("nemo-gym", base_url=server_url)
    task = _task(counter_row("wal2", 1, [5]))
    store: list[bytes] = []

    def after_seed(s: Session, state: NemoGymState) -> bool:
        return state.journal.phase == "open" and not s.turns

    with pytest.raises(_Crash):
        _episode(env, task, after_seed, store)
    written = env.decode_state(session_codec.SESSION.decode(store[-1]).state)
    assert written.journal.phase == "opening"  # written ahead of the seed
    traj = _episode(env, task, None, store)
    state = env.decode_state(traj.state)
    assert env.verify(task, traj, state).reward == 1.0
    lost, used = _server_calls(server_url, "wal2")[::-1]  # the empty one sorts last
    # the lost session holds nothing: no call is sent before its seed is checkpointed
    assert lost == ([], False, 0)
    assert used == (["increment_counter:5"], True, 1)
    assert (state.journal.attempt, state.journal.lost) == (1, 1)


def test_a_typed_seed_answered_but_not_checkpointed_is_closed_by_its_id(typed_url):
    """NeMo Gym 0.7's typed seed names the session: the one whose answer was lost is closed by
    that id (by a fresh env, as a new worker process would be, which reads the server's OpenAPI
    schema to know it takes typed seeds), and the episode goes on as attempt 1."""
    task = _task(counter_row("wal2t", 1, [5]))
    store: list[bytes] = []

    def after_seed(s: Session, state: NemoGymState) -> bool:
        return state.journal.phase == "open" and not s.turns

    with pytest.raises(_Crash):
        _episode(make_env("nemo-gym", base_url=typed_url), task, after_seed, store)
    env = make_env("nemo-gym", base_url=typed_url)
    traj = _episode(env, task, None, store)
    state = env.decode_state(traj.state)
    assert env.verify(task, traj, state).reward == 1.0
    records = {sid: r for sid, r in sessions(typed_url).items() if r["label"] == "wal2t"}
    assert records.keys() == {"wal2t_3a0", "wal2t_3a0-a1"}  # EpisodeId.capture_key of each
    lost, used = records["wal2t_3a0"], records["wal2t_3a0-a1"]
    assert (lost["calls"], lost["closed"], lost["verifies"]) == ([], True, 0)
    assert lost["episode_id"] == {"rollout_id": "wal2t_3a0", "attempt": 0}
    assert (used["calls"], used["closed"], used["verifies"]) == (["increment_counter:5"], True, 1)
    assert used["episode_id"] == {"rollout_id": "wal2t_3a0", "attempt": 1}
    assert state.protocol == "typed" and state.resources_session_id == "wal2t_3a0-a1"
    j = state.journal
    assert (j.attempt, j.lost, j.closed) == (1, 0, 1)


def test_a_replay_the_server_cannot_reproduce_drops_the_sample(server_url):
    env = make_env("nemo-gym", base_url=server_url)
    row = counter_row("wal3", 0, [1], extra_calls=[{"name": "draw_ticket", "arguments": "{}"}])
    row["reference_output"].insert(0, row["reference_output"].pop(-3))  # the ticket first
    row["reference_output"].insert(1, row["reference_output"].pop(-2))
    row["responses_create_params"]["tools"] = [*COUNTER_TOOLS, TICKET_TOOL]
    task = _task(row)
    store: list[bytes] = []
    with pytest.raises(_Crash):
        _episode(env, task, _after_answer_of("call_0"), store)  # the increment, after the ticket
    with pytest.raises(ReplayDiverged, match=r"draw_ticket.*cannot reproduce this episode"):
        _episode(env, task, None, store)
    # both sessions were closed: the one with the unconfirmed call, the one the replay failed in
    assert [closed for _, closed, _ in _server_calls(server_url, "wal3")] == [True, True]


def test_with_replay_off_an_unconfirmed_call_drops_the_sample(server_url):
    env = make_env("nemo-gym", base_url=server_url, replay=False)
    task = _task(counter_row("wal4", 0, [1, 2]))
    store: list[bytes] = []
    with pytest.raises(_Crash):
        _episode(env, task, _after_answer_of("call_0"), store)
    with pytest.raises(EnvUnavailable, match="call_0 was sent and not confirmed; replay is off"):
        _episode(env, task, None, store)
    assert _server_calls(server_url, "wal4") == [(["increment_counter:1"], True, 0)]


def test_an_answer_lost_while_the_worker_lives_is_recovered_the_same_way(server_url):
    """The server applies the call and answers too late: no retry in that session."""
    env = make_env("nemo-gym", base_url=server_url, timeout_s=0.5, retries=1, backoff_s=0.0)
    task = _task(counter_row("wal5", 3, [1, 2], fault="tool_lost_answer", slow_s=2.0))
    traj = _episode(env, task, None, [])
    state = env.decode_state(traj.state)
    assert env.verify(task, traj, state).reward == 1.0
    first, second = _server_calls(server_url, "wal5")
    assert first == (["increment_counter:1"], True, 0)
    assert second == (["increment_counter:1", "increment_counter:2"], True, 1)
    assert (state.journal.attempt, state.journal.closed) == (1, 1)


def test_a_journal_entry_is_written_before_each_request(server_url):
    """Every request that may change the server follows a checkpoint that announces it."""
    env = make_env("nemo-gym", base_url=server_url)
    task = _task(counter_row("wal6", 0, [1, 1]))
    seen: list[tuple[str, str | None, int]] = []

    def watch(s: Session, state: NemoGymState) -> bool:
        seen.append((state.journal.phase, state.journal.sending, state.journal.applied))
        return False

    traj = _episode(env, task, watch, [])
    assert seen[:6] == [
        ("opening", None, 0),  # before /seed_session
        ("open", None, 0),  # its answer
        ("open", "call_0", 0),  # before the call, with the model turn that made it
        ("open", None, 1),  # its output
        ("open", None, 1),  # the end of the turn
        ("open", "call_1", 1),
    ]
    assert _calls(traj) == ["increment_counter:1", "increment_counter:1"]


def test_calls_and_their_outputs_pair_in_the_order_they_were_applied():
    a = FunctionCall(call_id="a", name="x", arguments="{}")
    b = FunctionCall(call_id="b", name="y", arguments="{}")
    items: list[Any] = [a, b, FunctionCallOutput(call_id="b", output="1"),
                        FunctionCallOutput(call_id="a", output="2")]  # fmt: skip
    assert confirmed_calls(items) == [(b, "1"), (a, "2")]
    assert confirmed_calls([a]) == []
