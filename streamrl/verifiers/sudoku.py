"""Sudoku: a counting solver, a generator of unique-solution puzzles, and the score.

Boards are flat lists of ``size * size`` ints, row-major, 0 for empty. Sizes 4 (2x2 boxes),
6 (2x3) and 9 (3x3).

Reward (``score``): 1.0 when the board equals the solution. Otherwise partial credit
``0.5 * max(0, correct - wrong) / blanks``, where ``blanks`` are the puzzle's empty cells,
``correct`` those holding the solution's digit, and ``wrong`` the blanks holding another digit
plus any given that was changed. So an unsolved board earns at most 0.5, givens earn nothing,
and filling cells at random does not pay: each wrong digit cancels a right one.
"""

from __future__ import annotations

import random

_BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}


def box_shape(size: int) -> tuple[int, int]:
    if size not in _BOXES:
        raise ValueError(f"sudoku size must be one of {sorted(_BOXES)}, got {size}")
    return _BOXES[size]


def _units(size: int) -> list[tuple[int, int, int]]:
    """(row, col, box) of every cell."""
    br, bc = box_shape(size)
    return [
        (i // size, i % size, (i // size // br) * br + (i % size) // bc) for i in range(size**2)
    ]


def count_solutions(board: list[int], size: int, limit: int = 2) -> tuple[int, list[int] | None]:
    """How many solutions (up to ``limit``) and the first one found. Bitmask backtracking,
    filling the cell with the fewest candidates first."""
    units = _units(size)
    full = (1 << (size + 1)) - 2  # bits 1..size
    rows, cols, boxes = [0] * size, [0] * size, [0] * size
    grid = list(board)
    for i, d in enumerate(grid):
        if d:
            r, c, b = units[i]
            bit = 1 << d
            if (rows[r] | cols[c] | boxes[b]) & bit:
                return 0, None  # the givens already clash
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
    empty = [i for i, d in enumerate(grid) if not d]
    found: list[list[int]] = []
    count = 0

    def search() -> None:
        nonlocal count
        best, best_mask, best_n = -1, 0, size + 1
        for i in empty:
            if grid[i]:
                continue
            r, c, b = units[i]
            mask = full & ~(rows[r] | cols[c] | boxes[b])
            n = mask.bit_count()
            if n < best_n:
                best, best_mask, best_n = i, mask, n
                if n <= 1:
                    break
        if best < 0:
            count += 1
            if not found:
                found.append(list(grid))
            return
        r, c, b = units[best]
        mask = best_mask
        while mask and count < limit:
            bit = mask & -mask
            mask ^= bit
            grid[best] = bit.bit_length() - 1
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            search()
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        grid[best] = 0

    search()
    return count, (found[0] if found else None)


def generate(rng: random.Random, size: int = 4, max_blanks: int | None = None):
    """(puzzle, solution) with exactly one solution: a shuffled full grid with cells removed in
    random order, each only while the puzzle stays unique."""
    br, bc = box_shape(size)
    digits = list(range(1, size + 1))
    rng.shuffle(digits)

    def shuffled_lines(groups: int, per: int) -> list[int]:
        order = list(range(groups))
        rng.shuffle(order)
        out = []
        for g in order:
            inner = list(range(per))
            rng.shuffle(inner)
            out.extend(g * per + k for k in inner)
        return out

    row_order = shuffled_lines(bc, br)  # bc bands of br rows
    col_order = shuffled_lines(br, bc)  # br stacks of bc columns
    solution = [digits[(bc * (r % br) + r // br + c) % size] for r in row_order for c in col_order]
    puzzle = list(solution)
    cells = list(range(size * size))
    rng.shuffle(cells)
    blanks = 0
    for i in cells:
        if max_blanks is not None and blanks >= max_blanks:
            break
        keep = puzzle[i]
        puzzle[i] = 0
        if count_solutions(puzzle, size)[0] == 1:
            blanks += 1
        else:
            puzzle[i] = keep
    return puzzle, solution


def conflict(board: list[int], size: int, index: int, digit: int) -> str | None:
    """Why ``digit`` cannot go at ``index`` given the other digits on the board, or None."""
    units = _units(size)
    r, c, b = units[index]
    for j, (r2, c2, b2) in enumerate(units):
        if j != index and board[j] == digit:
            if r2 == r:
                return f"{digit} is already in row {r + 1}"
            if c2 == c:
                return f"{digit} is already in column {c + 1}"
            if b2 == b:
                return f"{digit} is already in that box"
    return None


def render(board: list[int], size: int) -> str:
    br, bc = box_shape(size)
    lines = []
    for r in range(size):
        if r and r % br == 0:
            lines.append("-" * (2 * size + 2 * (size // bc - 1) - 1))
        row = board[r * size : (r + 1) * size]
        groups = [
            " ".join(str(d) if d else "." for d in row[k : k + bc]) for k in range(0, size, bc)
        ]
        lines.append(" | ".join(groups))
    return "\n".join(lines)


def score(puzzle: list[int], solution: list[int], board: list[int]) -> dict[str, float]:
    """The components; ``reward`` as defined in the module docstring."""
    blanks = [i for i, d in enumerate(puzzle) if not d]
    correct = sum(board[i] == solution[i] for i in blanks)
    wrong = sum(board[i] not in (0, solution[i]) for i in blanks)
    wrong += sum(board[i] != puzzle[i] for i, d in enumerate(puzzle) if d)
    solved = board == solution
    partial = max(0, correct - wrong) / len(blanks) if blanks else 1.0
    return {
        "reward": 1.0 if solved else 0.5 * partial,
        "solved": float(solved),
        "correct": correct / len(blanks) if blanks else 1.0,
        "wrong": float(wrong),
    }
