"""The trajectory browser's reads (``ops/web/browse.py``) on a real Redis: a search pages
through the groups stream by entry ID in bounded steps, over every shard, newest first, and
each filter keeps what it says; an episode reads as a conversation with its errors marked."""

from __future__ import annotations

import pytest

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.values import id_order
from streamrl.config import RunConfig, StreamConfig
from streamrl.ops.web import browse
from streamrl.ops.web.conversation import conversation
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, ModelTurn
from streamrl.workers.context import write_config


def _sample(prompt: str, k: int, reward: float | None, version: int, env: str) -> schema.Sample:
    call = FunctionCall(call_id="c0", name="add", arguments='{"n": 2}' if k else "{n: ")
    answer = Message(role="assistant", content=f"answer {prompt} {k}")
    output = FunctionCallOutput(call_id="c0", output="3" if k else "error: bad JSON")
    items = [Message(role="user", content="add 2"), call, output, answer]
    turns = [ModelTurn(index=0, items=[call], policy_version=version),
             ModelTurn(index=1, items=[answer], policy_version=version)]  # fmt: skip
    traj = schema.Trajectory(
        task_id=f"{prompt}:{k}", prompt_id=prompt, k=k, group_size=2, env=env, items=items,
        n_input=1, turns=turns, status="completed",
    )  # fmt: skip
    score = schema.Score(
        task_id=traj.task_id, prompt_id=prompt, k=k, reward=reward, verifier="v",
        verifier_version="2" if version > 3 else "1", policy_versions=[version], env=env,
        failure=None if reward is not None else "verifier crashed",
    )  # fmt: skip
    return schema.Sample(score=score, trajectory=traj)


def _add_group(r, stream: str, i: int) -> None:
    env = "counter" if i % 2 else "copy"
    members = [_sample(f"p{i:03d}", k, float(k), i // 5, env) for k in range(2)]
    r.xadd(stream, {"p": schema.encode(schema.Group(schema.SCHEMA_VERSION, f"p{i:03d}", 2,
                                                    0.5, 0.5, members))})  # fmt: skip


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(browse, "SCAN_PAGE", 3)
    monkeypatch.setattr(browse, "SCAN_LIMIT", 7)
    monkeypatch.setattr(browse, "PAGE_SAMPLES", 5)


def _all_pages(r, run: str, q: browse.Query) -> tuple[list[str], int]:
    seen, ids, cursor, requests = [], [], None, 0
    while True:
        page = browse.search(r, run, q, cursor)
        requests += 1
        assert page.scanned <= browse.SCAN_LIMIT
        seen += [row.task_id for row in page.rows]
        ids += [id_order(row.entry_id) for row in page.rows]
        assert ids == sorted(ids, reverse=True)  # newest first, across pages and shards
        if page.next_cursor is None:
            return seen, requests
        cursor = page.next_cursor


def test_search_pages_by_id_and_filters(r, run_name, small_pages):
    groups = Keys(run_name).groups
    for i in range(30):
        _add_group(r, groups, i)
    r.xadd(groups, {"p": b"\x93not a group"})  # an entry that does not decode is counted
    every, requests = _all_pages(r, run_name, browse.Query())
    expected = [f"p{i:03d}:{k}" for i in reversed(range(30)) for k in range(2)]
    assert every == expected and requests >= 30 // browse.SCAN_LIMIT
    first = browse.search(r, run_name, browse.Query())
    assert first.undecodable == 1 and len(first.rows) >= browse.PAGE_SAMPLES

    def found(**kw) -> set[str]:
        return set(_all_pages(r, run_name, browse.Query(**kw))[0])

    assert found(prompt="p01") == {f"p{i:03d}:{k}" for i in range(10, 20) for k in range(2)}
    assert found(min_reward=1.0) == {f"p{i:03d}:1" for i in range(30)}
    assert found(max_reward=0.5, env="counter") == {f"p{i:03d}:0" for i in range(1, 30, 2)}
    assert found(version=2) == {f"p{i:03d}:{k}" for i in range(10, 15) for k in range(2)}
    assert found(verifier_version="1") == {f"p{i:03d}:{k}" for i in range(20) for k in range(2)}
    assert found(text="answer p007 1") == {"p007:1"}
    assert found(prompt="nowhere") == set()


def test_search_merges_shards_newest_first(r, run_name, small_pages, monkeypatch):
    write_config(r, RunConfig(run=run_name, env="counter", streams=StreamConfig(shards=2)))
    shards = [Keys(run_name, s, 2) for s in range(2)]
    for i in range(12):
        _add_group(r, shards[i % 2].groups, i)
    every, _ = _all_pages(r, run_name, browse.Query())
    # every sample once; entries of two shards written in the same millisecond may share an
    # ID, and then no order between them is the true one
    assert sorted(every) == [f"p{i:03d}:{k}" for i in range(12) for k in range(2)]
    monkeypatch.setattr(browse, "SCAN_LIMIT", 100)
    row = browse.search(r, run_name, browse.Query(prompt="p003")).rows[0]
    assert row.shard == 1 and browse.group(r, run_name, 1, row.entry_id).prompt_id == "p003"
    with pytest.raises(browse.NotFound):
        browse.group(r, run_name, 1, "1-1")
    with pytest.raises(browse.NotFound):
        browse.group(r, run_name, 2, row.entry_id)


def test_conversation_marks_errors_and_versions():
    turns = conversation(_sample("p", 0, 0.0, 7, "counter").trajectory)
    assert [t.kind for t in turns] == ["message", "function_call", "function_call_output",
                                       "message"]  # fmt: skip
    user, call, output, answer = turns
    assert user.is_input and user.version is None
    assert call.error.startswith("arguments are not JSON") and call.version == 7
    assert output.error and output.name == "add"
    assert answer.turn == 1 and not answer.error
    good = conversation(_sample("p", 1, 1.0, 7, "counter").trajectory)[1]
    assert good.text == '{\n  "n": 2\n}' and not good.error


def test_long_text_is_folded_behind_its_first_line():
    traj = _sample("p", 1, 1.0, 0, "copy").trajectory
    traj.items[-1] = Message(role="assistant", content="first line\n" + "x" * 700)
    answer = conversation(traj)[-1]
    assert answer.folded and answer.summary == "first line"
    assert not conversation(_sample("p", 1, 1.0, 0, "copy").trajectory)[-1].folded
