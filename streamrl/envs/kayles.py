"""``kayles``: Kayles against an optimal opponent, scored by Grundy values.

Rows of pins; a move knocks down one pin or two adjacent pins in one row, which may split it
in two; whoever knocks down the last pin wins. Move with ``knock(row, pin, count)`` or by
writing ``knock 2 from row 1 at pin 3`` (pins 3 and 4 of row 1; one move per message, see
``_impartial.py``). Rows are renumbered after
each move: empty rows disappear and a split row becomes two.

Reward (``verifiers/games.py``): ``0.5 * accuracy + 0.5 * outcome``, with Kayles Grundy values
(computed by mex; XOR over rows). Options: ``rows`` (default 2), ``max_row`` (default 7), and
those of ``_impartial.py``.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Any

import msgspec

from streamrl.envs._impartial import GameOptions, ImpartialGameEnv
from streamrl.schema import FunctionTool
from streamrl.verifiers.games import Kayles, Move


class KaylesEnv(ImpartialGameEnv):
    name = "kayles"

    class Options(GameOptions, kw_only=True):
        rows: Annotated[int, msgspec.Meta(ge=1, le=10)] = 2
        max_row: Annotated[int, msgspec.Meta(ge=1, le=30)] = 7

    version = "2"
    verifier_name = "grundy"
    verifier_version = "1"
    game = Kayles()
    move_pattern = re.compile(
        r"knock\s+(\d+)\s+(?:pins?\s+)?from\s+row\s+(\d+)\s+at\s+pin\s+(\d+)", re.I
    )
    move_example = "knock <count> from row <row> at pin <pin>"
    rules_text = (
        "Let's play Kayles. There are rows of pins, numbered from 1 left to right. On your "
        "turn knock down one pin, or two pins next to each other, in a single row; a row can "
        "split in two. Whoever knocks down the last pin wins."
    )
    tools = [
        FunctionTool(
            name="knock",
            description="Knock down `count` (1 or 2) adjacent pins of row `row`, starting at "
            "pin `pin` (rows and pins count from 1).",
            parameters={
                "type": "object",
                "properties": {
                    "row": {"type": "integer", "minimum": 1},
                    "pin": {"type": "integer", "minimum": 1},
                    "count": {"type": "integer", "enum": [1, 2]},
                },
                "required": ["row", "pin", "count"],
                "additionalProperties": False,
            },
        )
    ]

    def random_start(self, rng: random.Random) -> list[int]:
        n, top = int(self.options.get("rows", 2)), int(self.options.get("max_row", 7))
        return [rng.randint(1, top) for _ in range(n)]

    def describe(self, position: list[int]) -> str:
        return "; ".join(f"row {i + 1}: {'I' * n} ({n} pins)" for i, n in enumerate(position))

    def say_move(self, move: Move) -> str:
        row, pin, count = move
        return f"knock {count} from row {row} at pin {pin}"

    def tool_move(self, arguments: dict[str, Any]) -> Move:
        return (arguments["row"], arguments["pin"], arguments["count"])

    def miscount(self, position: list[int]) -> Move:
        """Two pins from the last pin of the first row: one past its end."""
        return (1, position[0], 2)

    def parse(self, groups: tuple[str, ...]) -> Move:
        count, row, pin = (int(g) for g in groups)
        return (row, pin, count)
