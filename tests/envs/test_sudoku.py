"""``sudoku``: unique puzzles, the reference solves them, wrong play earns less."""

from __future__ import annotations

import json
import random

import pytest

from streamrl.defaults import MAX_MOVE_MESSAGE_CHARS
from streamrl.envs.sudoku import SudokuEnv
from streamrl.schema import FunctionCall
from streamrl.verifiers import sudoku as rules


@pytest.mark.parametrize("size", [4, 6, 9])
def test_generated_puzzles_have_exactly_one_solution(size):
    rng = random.Random(size)
    for _ in range(3 if size == 9 else 10):
        puzzle, solution = rules.generate(rng, size)
        assert rules.count_solutions(puzzle, size)[0] == 1
        assert rules.count_solutions(puzzle, size)[1] == solution
        assert all(p in (0, s) for p, s in zip(puzzle, solution, strict=True))
        assert 0 in puzzle
        for i, d in enumerate(solution):
            assert rules.conflict(solution, size, i, d) is None


def test_counting_finds_multiple_solutions():
    assert rules.count_solutions([0] * 16, 4)[0] == 2
    assert rules.count_solutions([1, 1] + [0] * 14, 4)[0] == 0


@pytest.mark.parametrize("size", [4, 9])
def test_reference_solves_by_message(episode, size):
    env = SudokuEnv(size=size)
    task = episode.make_task(env, seed=3)
    trajectory, state = episode.play(env, task, env.reference)
    verdict = env.verify(task, trajectory, state)
    assert verdict.reward == 1.0 and verdict.components["solved"] == 1.0


def test_solving_with_the_tool_scores_one(episode):
    env = SudokuEnv()
    task = episode.make_task(env, seed=5)
    puzzle, solution = task.data["puzzle"], task.data["solution"]
    moves = [
        ("place", {"row": i // 4 + 1, "col": i % 4 + 1, "digit": solution[i]})
        for i, d in enumerate(puzzle)
        if not d
    ]
    trajectory, state = episode.play(env, task, episode.calls(moves))
    assert state.board == solution and state.moves == len(moves)
    assert "Solved!" in trajectory.items[-2].output  # the last tool output, before "done"
    assert env.verify(task, trajectory, state).reward == 1.0


def test_givens_and_conflicts_are_refused(episode):
    env = SudokuEnv()
    task = episode.make_task(env, seed=1)
    state = env.reset(task)
    given = next(i for i, d in enumerate(state.givens) if d)
    blank = next(i for i, d in enumerate(state.givens) if not d)
    other = next(d for d in range(1, 5) if d != state.givens[given])

    def call(i, d):
        args = {"row": i // 4 + 1, "col": i % 4 + 1, "digit": d}
        return env.call_tool(
            state, FunctionCall(call_id="c", name="place", arguments=json.dumps(args))
        )

    out = call(given, other)
    assert out.output.startswith("error:") and "given" in out.output and out.state == state
    # a digit already present in the blank's row is refused
    row = blank // 4
    present = next(d for d in state.givens[row * 4 : row * 4 + 4] if d)
    out = call(blank, present)
    assert out.output.startswith("error:") and "refused" in out.output


def test_partial_and_wrong_boards(episode):
    env = SudokuEnv()
    task = episode.make_task(env, seed=2)
    puzzle, solution = task.data["puzzle"], task.data["solution"]
    blanks = [i for i, d in enumerate(puzzle) if not d]
    # one right digit, then stop: partial credit below a solve
    i = blanks[0]
    verdict = episode.score(
        env, task, episode.say(f"r{i // 4 + 1}c{i % 4 + 1}={solution[i]}", "done")
    )
    assert verdict.reward == pytest.approx(0.5 / len(blanks))
    # nothing placed: nothing earned
    assert episode.score(env, task, episode.say("I give up")).reward == 0.0
    # a wrong board scored directly: wrong digits cancel right ones
    board = list(solution)
    board[blanks[0]] = solution[blanks[0]] % 4 + 1
    parts = rules.score(puzzle, solution, board)
    assert parts["reward"] == pytest.approx(0.5 * (len(blanks) - 2) / len(blanks))
    # changing a given never pays
    g = next(i for i, d in enumerate(puzzle) if d)
    board = list(solution)
    board[g] = solution[g] % 4 + 1
    assert rules.score(puzzle, solution, board)["reward"] < 1.0


def test_state_round_trips(episode):
    env = SudokuEnv(size=9)
    task = episode.make_task(env, seed=4)
    state = env.reset(task)
    assert env.decode_state(env.encode_state(state)) == state


def test_registered():
    from streamrl.envs.registry import make_env

    assert type(make_env("sudoku", size=9)) is SudokuEnv


def test_a_cell_written_twice_with_different_digits_refuses_the_message(episode):
    """Moves used to be applied one by one, so "r1c1=1 r1c1=2 ..." tried every digit and a
    message holding a wrong and a right answer kept the right one."""
    env = SudokuEnv()
    task = episode.make_task(env, seed=2)
    state = env.reset(task)
    i = next(i for i, d in enumerate(state.givens) if not d)
    cell = f"r{i // 4 + 1}c{i % 4 + 1}"
    reply = env.reply(state, f"{cell}={task.data['solution'][i] % 4 + 1} {cell}=0")
    assert reply.message.startswith("error:") and "more than once" in reply.message
    assert reply.state.board == state.board and reply.state.refused == 1 and not reply.done
    # the same move twice is one move
    same = f"{cell}={task.data['solution'][i]}"
    assert env.reply(state, f"{same} {same}").state.board[i] == task.data["solution"][i]


def test_a_message_longer_than_the_cap_places_nothing(episode):
    env = SudokuEnv()
    state = env.reset(episode.make_task(env, seed=2))
    reply = env.reply(state, "r1c1=1 " * (MAX_MOVE_MESSAGE_CHARS // 7 + 1))
    assert reply.message.startswith("error:") and reply.state.board == state.board
    assert reply.state.refused == 1


def test_a_message_that_changes_nothing_ends_the_episode(episode):
    env = SudokuEnv()
    task = episode.make_task(env, seed=2)
    state = env.reset(task)
    i = next(i for i, d in enumerate(state.givens) if not d)
    move = f"r{i // 4 + 1}c{i % 4 + 1}={task.data['solution'][i]}"
    first = env.reply(state, move)
    assert not first.done and env.reply(first.state, f"still {move}").done


def test_wrong_agent_scores_below_max(episode):
    env = SudokuEnv()
    for seed in range(6):
        task = episode.make_task(env, seed=seed)
        assert 0.0 < episode.score(env, task, env.wrong).reward < 1.0


@pytest.mark.parametrize("size", [4, 9])
def test_cheats_score_no_more_than_the_wrong_agent(episode, size):
    """The leaks the audit found: the wrong and the right fill in one message, a 100k spray
    of every move (which used to solve any board), and the prompt echoed."""
    env = SudokuEnv(size=size)
    for seed in range(3):
        task = episode.make_task(env, seed=seed)
        wrong = episode.score(env, task, env.wrong).reward
        right = env.reference(task, [], env.reset(task)).content
        spray = " ".join(
            f"r{r}c{c}={d}"
            for r in range(1, size + 1)
            for c in range(1, size + 1)
            for d in range(1, size + 1)
        )
        cheats = {
            "both": env.wrong(task, [], env.reset(task)).content + "\n" + right,
            "spray": (spray + "\n") * (100_000 // len(spray)),
            "echo": task.input[0].content,
        }
        for name, text in cheats.items():
            verdict = episode.score(env, task, episode.say(text))
            assert verdict.reward <= wrong, (seed, name, verdict)
