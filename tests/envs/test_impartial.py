"""``nim`` and ``kayles``: optimal play scores the maximum, blunders and lucky wins do not."""

from __future__ import annotations

import json

import pytest

from streamrl.defaults import MAX_MOVE_MESSAGE_CHARS
from streamrl.envs.kayles import KaylesEnv
from streamrl.envs.nim import NimEnv
from streamrl.schema import FunctionCall, Message

ENVS = [NimEnv, KaylesEnv]


def _tool_call(env, move):
    """The tool's properties are declared in move order: (heap, count), (row, pin, count)."""
    names = list(env.tools[0].parameters["properties"])
    args = dict(zip(names, move, strict=True))
    return FunctionCall(call_id="c", name=env.tools[0].name, arguments=json.dumps(args))


def _weak(env):
    """Plays a non-winning move whenever it can: the first move that leaves a non-zero value."""

    def policy(task, items, state):
        if state.done:
            return Message(role="assistant", content="gg")
        moves = env.game.moves(state.position)
        bad = [m for m in moves if env.game.grundy(env.game.apply(state.position, m)) != 0]
        return Message(role="assistant", content=env.say_move((bad or moves)[0]))

    return policy


@pytest.mark.parametrize("cls", ENVS)
def test_generator_makes_winning_and_losing_starts(episode, cls):
    env = cls()
    kinds = {env.game.grundy(episode.make_task(env, seed=s).data["start"]) != 0 for s in range(30)}
    assert kinds == {True, False}
    assert episode.make_task(env, seed=4).data == episode.make_task(env, seed=4).data


@pytest.mark.parametrize("cls", ENVS)
def test_reference_scores_one_from_every_start(episode, cls):
    env = cls()
    for seed in range(12):
        task = episode.make_task(env, seed=seed)
        trajectory, state = episode.play(env, task, env.reference)
        verdict = env.verify(task, trajectory, state)
        assert state.done and verdict.reward == 1.0, (seed, verdict)
        winning = env.game.grundy(task.data["start"]) != 0
        assert verdict.components["won"] == float(winning)


@pytest.mark.parametrize("cls", ENVS)
def test_optimal_play_by_tool_scores_one(episode, cls):
    env = cls()
    task = episode.make_task(env, seed=1)

    def policy(task, items, state):
        if state.done:
            return Message(role="assistant", content="gg")
        return _tool_call(env, env.game.best_move(state.position))

    trajectory, state = episode.play(env, task, policy)
    assert any(isinstance(i, FunctionCall) for i in trajectory.items)
    assert env.verify(task, trajectory, state).reward == 1.0


def _blunderable_tasks(env, episode, seeds):
    """Winning starts where a non-winning move exists (from Nim [1, 1, 1] every move wins)."""
    for seed in seeds:
        task = episode.make_task(env, seed=seed)
        start = task.data["start"]
        if len(env.game.winning_moves(start)) < len(env.game.moves(start)):
            yield task


@pytest.mark.parametrize("cls", ENVS)
def test_weak_play_from_winning_starts_scores_zero(episode, cls):
    """One non-winning move against a perfect opponent: the game and the accuracy are lost."""
    env = cls(winning_fraction=1.0)
    tasks = list(_blunderable_tasks(env, episode, range(8)))
    assert len(tasks) >= 4
    for task in tasks:
        verdict = episode.score(env, task, _weak(env))
        assert verdict.reward == 0.0 and verdict.components["finished"] == 1.0, verdict


@pytest.mark.parametrize("cls", ENVS)
def test_a_lucky_win_is_not_a_perfect_score(episode, cls):
    """Against an opponent that blunders, a model can win after its own mistake; the
    Grundy-based accuracy still marks the mistake."""
    env = cls(winning_fraction=1.0, blunder_rate=0.7)

    def blunder_first(task, items, state):
        if state.done:
            return Message(role="assistant", content="gg")
        first = not state.log
        return (_weak(env) if first else env.reference)(task, items, state)

    lucky = []
    for task in _blunderable_tasks(env, episode, range(40)):
        verdict = episode.score(env, task, blunder_first)
        if verdict.components["won"] == 1.0:
            lucky.append(verdict.reward)
    assert lucky, "no lucky win found; widen the seed range"
    assert all(0.5 < r < 1.0 for r in lucky)


@pytest.mark.parametrize("cls", ENVS)
def test_illegal_moves_are_refused_and_too_many_forfeit(episode, cls):
    env = cls()
    task = episode.make_task(env, seed=2)
    state = env.reset(task)
    bad = (99, 1) if env.name == "nim" else (99, 1, 1)
    out = env.call_tool(state, _tool_call(env, bad))
    assert out.output.startswith("error:") and out.state == state
    reply = env.reply(state, env.say_move(bad))
    assert reply.message.startswith("error:") and not reply.done
    assert reply.state.position == state.position and reply.state.illegal == 1
    verdict = episode.score(env, task, episode.say("hmm", "what", "no idea"))
    assert verdict.reward == 0.0 and verdict.components["finished"] == 0.0


@pytest.mark.parametrize("cls", ENVS)
def test_a_message_plays_its_one_move(episode, cls):
    """The prompt's syntax has placeholders, so mentioning it is not a move; writing the same
    move twice is one move."""
    env = cls()
    state = env.reset(episode.make_task(env, seed=3))
    move = env.game.moves(state.position)[-1]
    said = env.say_move(move)
    text = f"Moves look like {env.move_example}. I play {said}, yes, {said}."
    reply = env.reply(state, text)
    assert reply.state.log[0] == [0, *move] and reply.state.illegal == 0


@pytest.mark.parametrize("cls", ENVS)
def test_several_different_moves_are_an_invalid_move(episode, cls):
    """Used to play the last move written, so a message hedging between a wrong and a right
    move got the right one. Now it is refused like an illegal move and counts towards forfeit."""
    env = cls()
    state = env.reset(episode.make_task(env, seed=3))
    first, last = env.game.moves(state.position)[0], env.game.moves(state.position)[-1]
    reply = env.reply(state, f"Maybe {env.say_move(first)}? No: {env.say_move(last)}.")
    assert reply.message.startswith("error:") and "2 different moves" in reply.message
    assert reply.state.position == state.position and reply.state.illegal == 1 and not reply.done


@pytest.mark.parametrize("cls", ENVS)
def test_a_message_too_long_to_be_a_move_is_refused(episode, cls):
    env = cls()
    state = env.reset(episode.make_task(env, seed=3))
    move = env.say_move(env.game.best_move(state.position))
    reply = env.reply(state, "x" * MAX_MOVE_MESSAGE_CHARS + " " + move)
    assert reply.message.startswith("error:") and reply.state.illegal == 1
    assert reply.state.position == state.position


@pytest.mark.parametrize("cls", ENVS)
def test_wrong_agent_scores_below_max_from_every_start(episode, cls):
    env = cls()
    for seed in range(12):
        task = episode.make_task(env, seed=seed)
        assert episode.score(env, task, env.wrong).reward < 1.0, seed


@pytest.mark.parametrize("cls", ENVS)
def test_cheats_score_no_more_than_the_wrong_agent(episode, cls):
    """The leaks the audit found: every message holding both the wrong and the right move
    (paid as the right one), a 100k-character spray of moves, and the prompt echoed."""
    env = cls()
    for seed in range(12):
        task = episode.make_task(env, seed=seed)
        wrong = episode.score(env, task, env.wrong).reward

        def both(task, items, state):
            right = env.reference(task, items, state).content
            return Message(
                role="assistant", content=f"{env.wrong(task, items, state).content}\n{right}"
            )

        def spray(task, items, state):
            moves = " ".join(env.say_move(m) for m in env.game.moves(state.position))
            return Message(role="assistant", content=(moves + " ") * (100_000 // len(moves)))

        echo = episode.say(task.input[0].content)
        for name, cheat in {"both": both, "spray": spray, "echo": echo}.items():
            assert episode.score(env, task, cheat).reward <= wrong, (seed, name)


def test_registered():
    from streamrl.envs.registry import make_env

    assert type(make_env("nim")) is NimEnv and type(make_env("kayles")) is KaylesEnv
