"""``sudoku``: fill a small Sudoku, one move at a time, over several turns.

The model places digits with the ``place(row, col, digit)`` tool (``digit`` 0 clears a cell it
filled) or by writing moves such as ``r1c2=3`` in a message (several per message, applied in
order). The environment answers with the board, or an error: a given cannot be changed, and a
digit that already appears in the row, column or box is refused.

A message is refused as a whole (nothing applied, an error reply, counted in ``refused``) when
it writes **one cell twice with different digits** (a message hedging between answers must not
get the right one, nor "clear, then fill" be a way to try every digit) or is longer than
``MAX_MOVE_MESSAGE_CHARS`` (a spray of moves; a full 9x9 fill is about 600 characters). A
message that changes nothing - no moves, or only digits already on the board - ends the
episode; so does solving the puzzle by message. The prompt shows the move syntax with
placeholders, so echoing it places nothing.

Reward (see ``verifiers/sudoku.py``): 1.0 when solved, otherwise
``0.5 * max(0, correct - wrong) / blanks``.

Options: ``size`` (4, 6 or 9; default 4), ``max_blanks`` (cap on empty cells; default as many
as uniqueness allows).
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Literal

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
from streamrl.schema import FunctionTool, Item, Message, Task, Trajectory
from streamrl.verifiers import sudoku as rules

_MOVE = re.compile(r"\br\s*(\d+)\s*c\s*(\d+)\s*[=:]\s*(\d+)", re.IGNORECASE)


class SudokuState(msgspec.Struct):
    size: int
    givens: list[int]
    board: list[int]
    moves: int = 0
    refused: int = 0  # moves refused in messages (a refused tool call leaves state unchanged)


class SudokuEnv(Environment[SudokuState]):
    name = "sudoku"
    version = "2"
    verifier_name = "sudoku"
    verifier_version = "1"
    State = SudokuState

    class Options(msgspec.Struct, kw_only=True):
        size: Literal[4, 6, 9] = 4
        max_blanks: Annotated[int, msgspec.Meta(ge=1)] | None = None

    tools = [
        FunctionTool(
            name="place",
            description="Write a digit in a cell (rows and columns count from 1); "
            "digit 0 clears a cell you filled. Returns the board or an error.",
            parameters={
                "type": "object",
                "properties": {
                    "row": {"type": "integer", "minimum": 1, "maximum": 9},
                    "col": {"type": "integer", "minimum": 1, "maximum": 9},
                    "digit": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["row", "col", "digit"],
                "additionalProperties": False,
            },
        )
    ]

    def generate(self, rng: random.Random, index: int) -> Prompt:
        size = int(self.options.get("size", 4))
        max_blanks = self.options.get("max_blanks")
        puzzle, solution = rules.generate(
            rng, size, None if max_blanks is None else int(max_blanks)
        )
        br, bc = rules.box_shape(size)
        text = (
            f"Solve this {size}x{size} Sudoku: fill every empty cell (.) with a digit 1-{size} "
            f"so that each row, each column and each {br}x{bc} box holds every digit once.\n\n"
            f"{rules.render(puzzle, size)}\n\n"
            "Rows and columns are numbered from 1. Place digits with the place tool, or write "
            "moves like r<row>c<col>=<digit> (several per message, each cell at most once). "
            "Send a message without moves when done."
        )
        return Prompt([user(text)], {"size": size, "puzzle": puzzle, "solution": solution})

    def reset(self, task: Task) -> SudokuState:
        puzzle = [int(d) for d in task.data["puzzle"]]
        return SudokuState(size=int(task.data["size"]), givens=puzzle, board=list(puzzle))

    def _place(self, state: SudokuState, row: int, col: int, digit: int) -> SudokuState:
        n = state.size
        if not (1 <= row <= n and 1 <= col <= n and 0 <= digit <= n):
            raise ToolError(f"row and col must be 1-{n} and digit 0-{n}")
        i = (row - 1) * n + (col - 1)
        if state.givens[i]:
            raise ToolError(f"r{row}c{col} is a given and cannot be changed")
        if digit:
            why = rules.conflict(state.board, n, i, digit)
            if why:
                raise ToolError(f"r{row}c{col}={digit} refused: {why}")
        board = list(state.board)
        board[i] = digit
        return msgspec.structs.replace(state, board=board, moves=state.moves + 1)

    def _view(self, state: SudokuState) -> str:
        board = rules.render(state.board, state.size)
        return board + ("\nSolved!" if 0 not in state.board else "")

    def step(self, state: SudokuState, name: str, arguments: dict) -> StepResult:
        state = self._place(state, arguments["row"], arguments["col"], arguments["digit"])
        return StepResult(self._view(state), state)

    def reply(self, state: SudokuState, message: str) -> ReplyResult:
        if len(message) > MAX_MOVE_MESSAGE_CHARS:
            return self._refuse(
                state,
                f"message of {len(message)} characters; moves are read from messages of at "
                f"most {MAX_MOVE_MESSAGE_CHARS}",
            )
        moves = list(dict.fromkeys(tuple(map(int, m)) for m in _MOVE.findall(message)))
        cells: dict[tuple[int, int], int] = {}
        for row, col, digit in moves:
            if cells.setdefault((row, col), digit) != digit:
                return self._refuse(
                    state, f"r{row}c{col} is written more than once with different digits"
                )
        n = state.size
        if all(
            1 <= r <= n and 1 <= c <= n and state.board[(r - 1) * n + c - 1] == d
            for r, c, d in moves
        ):
            return ReplyResult(None, True, state)  # nothing new: done
        errors = []
        for row, col, digit in moves:
            try:
                state = self._place(state, row, col, digit)
            except ToolError as e:
                errors.append(str(e))
                state = msgspec.structs.replace(state, refused=state.refused + 1)
        if 0 not in state.board and not errors:
            return ReplyResult("Solved!", True, state)
        text = "\n".join([*(f"error: {e}" for e in errors), rules.render(state.board, state.size)])
        return ReplyResult(text, False, state)

    def _refuse(self, state: SudokuState, why: str) -> ReplyResult:
        state = msgspec.structs.replace(state, refused=state.refused + 1)
        text = f"error: {why}; nothing was placed\n{rules.render(state.board, state.size)}"
        return ReplyResult(text, False, state)

    def verify(self, task: Task, trajectory: Trajectory, state: SudokuState) -> Verdict:
        parts = rules.score(task.data["puzzle"], task.data["solution"], state.board)
        reward = parts.pop("reward")
        return Verdict(
            reward=reward,
            components=parts,
            details={"moves": str(state.moves), "refused": str(state.refused)},
        )

    def reference(self, task: Task, items: list[Item], state: SudokuState) -> Item:
        """Clear any wrong digits (one message), then fill every cell from the solution (the
        next), since a message may write each cell once."""
        solution, n = task.data["solution"], state.size
        clears, fills = [], []
        for i, d in enumerate(state.board):
            if d != solution[i]:
                (clears if d else fills).append(
                    f"r{i // n + 1}c{i % n + 1}={0 if d else solution[i]}"
                )
        return Message(role="assistant", content=" ".join(clears or fills) or "done")

    def wrong(self, task: Task, items: list[Item], state: SudokuState) -> Item:
        """A careless solver, in one message sent until it changes nothing: one blank gets a
        wrong digit that the givens allow, and the other blanks their solution digits, except
        those this wrong digit now blocks. (If every blank is forced by the givens, the wrong
        digit goes last and is refused, leaving that cell empty.)"""
        puzzle, solution, n = task.data["puzzle"], task.data["solution"], int(task.data["size"])
        blanks = [i for i, d in enumerate(puzzle) if not d]
        spot = next(
            (
                (i, d)
                for i in blanks
                for d in range(1, n + 1)
                if d != solution[i] and rules.conflict(puzzle, n, i, d) is None
            ),
            None,
        )
        board, moves = list(puzzle), []
        if spot is not None:
            board[spot[0]] = spot[1]
            moves.append(spot)
        for i in blanks:
            if spot is None or (i != spot[0] and rules.conflict(board, n, i, solution[i]) is None):
                board[i] = solution[i]
                moves.append((i, solution[i]))
        if spot is None:
            i = blanks[0]
            moves = [m for m in moves if m[0] != i] + [(i, solution[i] % n + 1)]
        text = " ".join(f"r{i // n + 1}c{i % n + 1}={d}" for i, d in moves)
        return Message(role="assistant", content=text)
