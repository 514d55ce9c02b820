"""Impartial games under normal play (whoever cannot move loses), and how a game is scored.

A position is a list of ints (Nim heaps, Kayles rows). By the Sprague-Grundy theorem the
Grundy value of a position is the XOR of its parts' values, and the player to move wins with
best play exactly when it is non-zero; a *winning move* is one to a position of value 0.
Knowing this, the verifier can tell a good move from a lucky one.

Reward (``score_game``): ``0.5 * accuracy + 0.5 * outcome`` where

- ``accuracy`` = of the model's moves made from a winning position (Grundy != 0), the fraction
  that were winning moves (to Grundy 0); 1.0 when the model never stood on a winning position
  (every move from a lost position is as good as any other);
- ``outcome`` = 1.0 when the game finished and the model either won or lost without ever
  holding a winning position (a forced loss: the most anyone could get); else 0.0. A game the
  model abandons or does not finish gets outcome 0, and its accuracy counts the turn it did
  not play as a move that failed to win (if that position was winning), with no vacuous 1.0.

So optimal play scores 1.0 from winning and losing starts alike, a blunder from a winning
position costs accuracy and (against a perfect opponent) the game, and a win that came from
the opponent's blunder after the model's own still scores below 1.0.
"""

from __future__ import annotations

import functools
from typing import ClassVar

Move = tuple[int, ...]


class IllegalMove(ValueError):
    """A move the rules forbid; the message says why, for the model."""


def mex(values: set[int]) -> int:
    """The minimum excludant: the smallest non-negative integer not in ``values``."""
    n = 0
    while n in values:
        n += 1
    return n


@functools.cache
def kayles_grundy(n: int) -> int:
    """Kayles on a row of n pins: knock down 1 or 2 adjacent pins, leaving rows a and b."""
    if n <= 0:
        return 0
    options = set()
    for take in (1, 2):
        for left in range(0, n - take + 1):
            options.add(kayles_grundy(left) ^ kayles_grundy(n - take - left))
    return mex(options)


class Game:
    """The rules of one impartial game; moves are 1-based tuples as the model writes them."""

    name: ClassVar[str] = ""

    def grundy_part(self, size: int) -> int:
        raise NotImplementedError

    def apply(self, position: list[int], move: Move) -> list[int]:
        raise NotImplementedError

    def moves(self, position: list[int]) -> list[Move]:
        raise NotImplementedError

    def grundy(self, position: list[int]) -> int:
        g = 0
        for part in position:
            g ^= self.grundy_part(part)
        return g

    def is_over(self, position: list[int]) -> bool:
        return not any(position)

    def winning_moves(self, position: list[int]) -> list[Move]:
        return [m for m in self.moves(position) if self.grundy(self.apply(position, m)) == 0]

    def best_move(self, position: list[int]) -> Move:
        """Deterministic optimal play: a winning move if there is one, else the move that
        removes the most (games stay short); ties go to the first in ``moves`` order."""
        winning = self.winning_moves(position)
        candidates = winning or self.moves(position)
        return max(
            candidates,
            key=lambda m: (sum(position) - sum(self.apply(position, m)), -candidates.index(m)),
        )


class Nim(Game):
    """Heaps of objects; a move ``(heap, count)`` takes ``count >= 1`` from one heap."""

    name = "nim"

    def grundy_part(self, size: int) -> int:
        return size

    def moves(self, position: list[int]) -> list[Move]:
        return [(h + 1, c) for h, size in enumerate(position) for c in range(1, size + 1)]

    def apply(self, position: list[int], move: Move) -> list[int]:
        if len(move) != 2:
            raise IllegalMove("a Nim move is (heap, count)")
        heap, count = move
        if not 1 <= heap <= len(position):
            raise IllegalMove(f"there is no heap {heap} (heaps are 1-{len(position)})")
        if not 1 <= count <= position[heap - 1]:
            raise IllegalMove(f"heap {heap} has {position[heap - 1]}; take between 1 and that")
        out = list(position)
        out[heap - 1] -= count
        return out


class Kayles(Game):
    """Rows of pins; a move ``(row, pin, count)`` knocks down ``count`` (1 or 2) adjacent pins
    starting at ``pin``, which may split the row in two. Empty rows disappear."""

    name = "kayles"

    def grundy_part(self, size: int) -> int:
        return kayles_grundy(size)

    def moves(self, position: list[int]) -> list[Move]:
        return [
            (r + 1, p, c)
            for r, size in enumerate(position)
            for c in (1, 2)
            for p in range(1, size - c + 2)
        ]

    def apply(self, position: list[int], move: Move) -> list[int]:
        if len(move) != 3:
            raise IllegalMove("a Kayles move is (row, pin, count)")
        row, pin, count = move
        if not 1 <= row <= len(position):
            raise IllegalMove(f"there is no row {row} (rows are 1-{len(position)})")
        size = position[row - 1]
        if count not in (1, 2):
            raise IllegalMove("knock down 1 or 2 adjacent pins")
        if not (pin >= 1 and pin + count - 1 <= size):
            raise IllegalMove(
                f"row {row} has pins 1-{size}; pins {pin}-{pin + count - 1} are not all there"
            )
        left, right = pin - 1, size - (pin - 1) - count
        out = [*position[: row - 1], left, right, *position[row:]]
        return [p for p in out if p > 0]


GAMES: dict[str, Game] = {"nim": Nim(), "kayles": Kayles()}

MODEL, OPPONENT = 0, 1


def replay(
    game: Game, start: list[int], log: list[list[int]]
) -> tuple[list[tuple[int, list[int], Move]], list[int]]:
    """Check a game log (``[player, *move]`` entries) against the rules from ``start``;
    returns (player, position before, move) per entry and the final position. Raises on an
    illegal entry: the environment never records one, so that is a corrupted trajectory."""
    plays = []
    position = list(start)
    for player, *move in log:
        plays.append((player, position, tuple(move)))
        position = game.apply(position, tuple(move))
    return plays, position


def score_game(game: Game, start: list[int], log: list[list[int]]) -> dict[str, float]:
    """The components and ``reward`` defined in the module docstring."""
    plays, position = replay(game, start, log)
    from_winning = good = 0
    for player, before, move in plays:
        if player == MODEL and game.grundy(before) != 0:
            from_winning += 1
            good += game.grundy(game.apply(before, move)) == 0
    finished = game.is_over(position)
    model_won = finished and bool(plays) and plays[-1][0] == MODEL
    if finished:
        accuracy = good / from_winning if from_winning else 1.0
    else:  # the model stopped on its own turn: that turn counts as a move that did not win
        denominator = from_winning + (game.grundy(position) != 0)
        accuracy = good / denominator if denominator else 0.0
    forced_loss = finished and not model_won and from_winning == 0
    outcome = 1.0 if model_won or forced_loss else 0.0
    return {
        "reward": 0.5 * accuracy + 0.5 * outcome,
        "accuracy": accuracy,
        "outcome": outcome,
        "won": float(model_won),
        "finished": float(finished),
        "start_winning": float(game.grundy(start) != 0),
        "model_moves": float(sum(p == MODEL for p, _, _ in plays)),
    }
