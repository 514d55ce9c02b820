"""Grundy values against brute-force game search, and the game score."""

from __future__ import annotations

import functools
import itertools

import pytest

from streamrl.verifiers.games import (
    GAMES,
    MODEL,
    OPPONENT,
    Kayles,
    Nim,
    kayles_grundy,
    mex,
    score_game,
)


def test_mex():
    assert mex(set()) == 0 and mex({0, 1, 3}) == 2 and mex({1, 2}) == 0


def test_kayles_values_match_the_known_sequence():
    # OEIS A002186
    assert [kayles_grundy(n) for n in range(12)] == [0, 1, 2, 3, 1, 4, 3, 2, 1, 4, 2, 6]


@pytest.mark.parametrize("name", ["nim", "kayles"])
def test_grundy_agrees_with_brute_force_search(name):
    game = GAMES[name]

    @functools.cache
    def to_move_wins(position: tuple[int, ...]) -> bool:
        return any(
            not to_move_wins(tuple(game.apply(list(position), m)))
            for m in game.moves(list(position))
        )

    for position in itertools.product(range(5), repeat=3):
        pos = [p for p in position if p] if name == "kayles" else list(position)
        assert (game.grundy(pos) != 0) == to_move_wins(tuple(pos)), pos
        if game.grundy(pos):
            assert game.best_move(pos) in game.winning_moves(pos)


def test_kayles_moves_split_rows():
    assert Kayles().apply([5], (1, 2, 2)) == [1, 2]
    assert Kayles().apply([3, 1], (2, 1, 1)) == [3]


def test_score_optimal_blunder_and_unfinished():
    nim = Nim()
    # [1, 2]: winning (nim-sum 3); the winning move takes 1 from heap 2 -> [1, 1]
    good = [[MODEL, 2, 1], [OPPONENT, 1, 1], [MODEL, 2, 1]]
    assert score_game(nim, [1, 2], good)["reward"] == 1.0
    blunder = [[MODEL, 2, 2], [OPPONENT, 1, 1]]
    parts = score_game(nim, [1, 2], blunder)
    assert parts["reward"] == 0.0 and parts["finished"] == 1.0
    # losing start [1, 1]: the model must lose, and playing it out is the best there is
    assert score_game(nim, [1, 1], [[MODEL, 1, 1], [OPPONENT, 2, 1]])["reward"] == 1.0
    # not finishing never earns the vacuous credit
    assert score_game(nim, [1, 1], [])["reward"] == 0.0
    assert score_game(nim, [1, 2], [])["reward"] == 0.0
    with pytest.raises(ValueError):
        score_game(nim, [1, 2], [[MODEL, 1, 5]])
