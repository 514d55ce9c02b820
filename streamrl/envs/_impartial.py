"""What the impartial-game environments share: play against an optimal opponent, move by
tool or by message, and scoring by Grundy values (``verifiers/games.py``).

The model always moves first; the opponent answers at once, so every turn the model sees is
its own. Illegal moves get an error and change nothing; ``max_illegal`` of them in messages
forfeit the game, which then scores as unfinished. A message is an invalid move, with the same
error and count, when it holds no move, **several different moves** (a message that hedges
between moves must not get the one that turns out right), or more than
``MAX_MOVE_MESSAGE_CHARS`` characters (a spray of every move). Writing the same move twice is
one move. The prompt shows the move syntax with placeholders, so echoing it is not a move.
The generator draws winning and losing starts (``winning_fraction``, default 0.5).
``blunder_rate`` (default 0) makes the opponent play a random legal move that often, drawn
from a per-task seed so that episodes replay identically.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Any, ClassVar

import msgspec

from streamrl.defaults import MAX_MOVE_MESSAGE_CHARS
from streamrl.envs.base import (
    Environment,
    Prompt,
    ReplyResult,
    StepResult,
    ToolError,
    Verdict,
    user,
)
from streamrl.schema import Item, Message, Task, Trajectory
from streamrl.verifiers.games import MODEL, OPPONENT, Game, IllegalMove, Move, score_game


class GameState(msgspec.Struct):
    position: list[int]
    log: list[list[int]] = []  # [player, *move]; player 0 is the model, 1 the opponent
    illegal: int = 0
    done: bool = False
    seed: int = 0  # the opponent's blunders are drawn from (seed, ply)


class GameOptions(msgspec.Struct, kw_only=True):
    """Options every impartial game takes; each game adds its board's size."""

    winning_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    blunder_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    max_illegal: Annotated[int, msgspec.Meta(ge=1)] = 3


class ImpartialGameEnv(Environment[GameState]):
    """Subclasses set ``game``, the tool, the move pattern and how to describe things."""

    State = GameState
    Options = GameOptions
    game: ClassVar[Game]
    move_pattern: ClassVar[re.Pattern[str]]
    move_example: ClassVar[str]  # the syntax with placeholders: not itself a move
    rules_text: ClassVar[str]

    # -- to fill in
    def random_start(self, rng: random.Random) -> list[int]:
        raise NotImplementedError

    def describe(self, position: list[int]) -> str:
        raise NotImplementedError

    def say_move(self, move: Move) -> str:
        raise NotImplementedError

    def tool_move(self, arguments: dict[str, Any]) -> Move:
        raise NotImplementedError

    def miscount(self, position: list[int]) -> Move:
        """An illegal move a careless player makes (one object too many): the wrong agent's
        move when it has no legal losing move to make."""
        raise NotImplementedError

    def parse(self, groups: tuple[str, ...]) -> Move:
        """A ``move_pattern`` match's groups as a move; default: the numbers in order."""
        return tuple(int(g) for g in groups)

    # -- tasks
    def generate(self, rng: random.Random, index: int) -> Prompt:
        want_winning = rng.random() < float(self.options.get("winning_fraction", 0.5))
        for _ in range(10_000):
            start = self.random_start(rng)
            if (self.game.grundy(start) != 0) == want_winning and any(start):
                break
        else:
            raise RuntimeError(f"{self.name}: no start position with the wanted value")
        text = (
            f"{self.rules_text}\n\nPosition: {self.describe(start)}\n\n"
            f"You move first, against a strong opponent. Make one move per turn with the "
            f"{self.tools[0].name} tool or by writing it like '{self.move_example}'."
        )
        data = {"start": start, "opponent_seed": rng.randrange(2**31)}
        return Prompt([user(text)], data)

    def reset(self, task: Task) -> GameState:
        start = [int(x) for x in task.data["start"]]
        return GameState(position=start, seed=int(task.data.get("opponent_seed", 0)))

    # -- playing
    def _opponent_move(self, state: GameState) -> Move:
        rate = float(self.options.get("blunder_rate", 0.0))
        rng = random.Random(state.seed * 1_000_003 + len(state.log))
        if rate > 0 and rng.random() < rate:
            return rng.choice(self.game.moves(state.position))
        return self.game.best_move(state.position)

    def _play(self, state: GameState, move: Move) -> tuple[str, GameState]:
        """The model's move, then the opponent's reply; raises ToolError when illegal."""
        if state.done:
            raise ToolError("the game is over")
        try:
            position = self.game.apply(state.position, move)
        except IllegalMove as e:
            raise ToolError(str(e)) from None
        log = [*state.log, [MODEL, *move]]
        state = msgspec.structs.replace(state, position=position, log=log)
        if self.game.is_over(position):
            return "You took the last move: you win.", msgspec.structs.replace(state, done=True)
        reply = self._opponent_move(state)
        position = self.game.apply(position, reply)
        state = msgspec.structs.replace(
            state, position=position, log=[*state.log, [OPPONENT, *reply]]
        )
        said = f"I play {self.say_move(reply)}."
        if self.game.is_over(position):
            return f"{said} That was the last move: I win.", msgspec.structs.replace(
                state, done=True
            )
        return f"{said} Position: {self.describe(position)}. Your move.", state

    def step(self, state: GameState, name: str, arguments: dict) -> StepResult:
        text, state = self._play(state, self.tool_move(arguments))
        return StepResult(text, state)

    def reply(self, state: GameState, message: str) -> ReplyResult:
        if state.done:
            return ReplyResult(None, True, state)
        try:
            text, state = self._play(state, self.read_move(message))
        except ToolError as e:
            state = msgspec.structs.replace(state, illegal=state.illegal + 1)
            if state.illegal >= int(self.options.get("max_illegal", 3)):
                return ReplyResult(f"error: {e}. Too many invalid moves: game over.", True, state)
            return ReplyResult(f"error: {e}", False, state)
        return ReplyResult(text, state.done, state)

    def read_move(self, message: str) -> Move:
        """The one move a message holds; ToolError when it holds none, several different
        ones, or is too long to be a move."""
        if len(message) > MAX_MOVE_MESSAGE_CHARS:
            raise ToolError(
                f"message of {len(message)} characters; write one move, at most "
                f"{MAX_MOVE_MESSAGE_CHARS} characters"
            )
        moves = list(
            dict.fromkeys(self.parse(m.groups()) for m in self.move_pattern.finditer(message))
        )
        if not moves:
            raise ToolError(f"no move found; write it like '{self.move_example}'")
        if len(moves) > 1:
            said = "; ".join(self.say_move(m) for m in moves[:5])
            raise ToolError(f"{len(moves)} different moves in one message ({said}); write one")
        return moves[0]

    # -- verification and the reference agent
    def verify(self, task: Task, trajectory: Trajectory, state: GameState) -> Verdict:
        parts = score_game(self.game, task.data["start"], state.log)
        return Verdict(
            reward=parts.pop("reward"),
            components=parts,
            details={"illegal": str(state.illegal), "moves": str(state.log)[:200]},
        )

    def reference(self, task: Task, items: list[Item], state: GameState) -> Item:
        if state.done:
            return Message(role="assistant", content="Good game.")
        return Message(role="assistant", content=self.say_move(self.game.best_move(state.position)))

    def wrong(self, task: Task, items: list[Item], state: GameState) -> Item:
        """A careless player: from a winning position a legal move that does not win (the
        first in ``moves`` order); otherwise a miscounted, illegal move, so that from a lost
        position it forfeits instead of playing the loss out (which scores the maximum)."""
        if state.done:
            return Message(role="assistant", content="Good game.")
        game, position = self.game, state.position
        losing = [m for m in game.moves(position) if game.grundy(game.apply(position, m)) != 0]
        move = losing[0] if game.grundy(position) != 0 and losing else self.miscount(position)
        return Message(role="assistant", content=self.say_move(move))
