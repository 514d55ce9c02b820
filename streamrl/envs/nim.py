"""``nim``: normal-play Nim against an optimal opponent, scored by Grundy values.

Heaps of stones; a move takes at least one stone from one heap; whoever takes the last stone
wins. Move with the ``take(heap, count)`` tool or by writing ``take 2 from heap 1``
(one move per message; see ``_impartial.py`` for what makes a message an invalid move).

Reward (``verifiers/games.py``): ``0.5 * accuracy + 0.5 * outcome``: accuracy is the fraction
of the model's moves from winning positions (nim-sum != 0) that were winning moves (to
nim-sum 0); outcome is 1 for a win, or for a finished forced loss. Options: ``heaps`` (number
of heaps, default 3), ``max_heap`` (default 5), and those of ``_impartial.py``.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Any

import msgspec

from streamrl.envs._impartial import GameOptions, ImpartialGameEnv
from streamrl.schema import FunctionTool
from streamrl.verifiers.games import Move, Nim


class NimEnv(ImpartialGameEnv):
    name = "nim"

    class Options(GameOptions, kw_only=True):
        heaps: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
        max_heap: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5

    version = "2"
    verifier_name = "grundy"
    verifier_version = "1"
    game = Nim()
    move_pattern = re.compile(r"take\s+(\d+)\s+(?:stones?\s+)?from\s+heap\s+(\d+)", re.I)
    move_example = "take <count> from heap <heap>"
    rules_text = (
        "Let's play Nim. There are heaps of stones. On your turn take one or more stones from "
        "a single heap. Whoever takes the last stone wins."
    )
    tools = [
        FunctionTool(
            name="take",
            description="Take `count` stones from heap number `heap` (heaps count from 1).",
            parameters={
                "type": "object",
                "properties": {
                    "heap": {"type": "integer", "minimum": 1},
                    "count": {"type": "integer", "minimum": 1},
                },
                "required": ["heap", "count"],
                "additionalProperties": False,
            },
        )
    ]

    def random_start(self, rng: random.Random) -> list[int]:
        n, top = int(self.options.get("heaps", 3)), int(self.options.get("max_heap", 5))
        return [rng.randint(1, top) for _ in range(n)]

    def describe(self, position: list[int]) -> str:
        return ", ".join(f"heap {i + 1}: {n}" for i, n in enumerate(position))

    def say_move(self, move: Move) -> str:
        heap, count = move
        return f"take {count} from heap {heap}"

    def tool_move(self, arguments: dict[str, Any]) -> Move:
        return (arguments["heap"], arguments["count"])

    def miscount(self, position: list[int]) -> Move:
        heap = max(range(len(position)), key=lambda h: position[h])
        return (heap + 1, position[heap] + 1)

    def parse(self, match: tuple[str, ...]) -> Move:
        count, heap = match
        return (int(heap), int(count))
