"""Sudoku 4x4 and 9x9 with a planner and an executor (the planner/executor protocol of
``planning.py``).

Puzzles are generated from a seed: a valid full grid from the canonical pattern
``(b * (r % b) + r // b + c) % n`` (b = box size) shuffled by digit relabelling, row swaps within
bands, band swaps, column swaps within stacks and stack swaps (all validity-preserving), then
``num_holes`` cells are blanked.

The executor replies with placements, one per line, ``row col value`` (1-based, e.g. ``2 3 4``).
A placement into a given (pre-filled) cell or out of range is a blocked no-op; a placement into a
blank cell (over)writes it, so mistakes can be corrected. The puzzle is solved when no cell is
blank and every row, column and box holds each value once (any valid completion counts, not only
the generated one). Team reward = 1 if solved. Progress (the tree-sampling check fn) = fraction of
blank cells currently holding the generated solution's value.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar, cast

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.env import ENVS, Task
from megamarl.orchestration.envs.planning import PlanExecEnv, PlanningConfig

Grid = tuple[tuple[int, ...], ...]


def parse_placements(text: str) -> tuple[list[tuple[int, int, int]], bool]:
    lines = re.findall(r"(?m)^\D*?(\d+)[\s,]+(\d+)[\s,:=]+(\d+)\s*$", text)
    found = cast("list[tuple[int, int, int]]", [tuple(int(x) for x in m) for m in lines])  # three groups
    return found, bool(found)


@AGENTS.register("sudoku_executor")
class SudokuExecutor(Agent):
    system_prompt = "You fill in Sudoku cells. Reply with lines 'row col value'."

    def parse(self, text: str):
        return parse_placements(text)


@dataclass(frozen=True)
class SudokuPuzzle:
    size: int
    givens: Grid  # 0 = blank
    solution: Grid


@dataclass
class SudokuConfig(PlanningConfig):
    size: int = 4
    num_holes: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size not in (4, 9):
            raise ValueError(f"env.size must be 4 or 9, got {self.size}")
        if not 1 <= self.num_holes <= self.size * self.size:
            raise ValueError(f"env.num_holes must be in [1, {self.size * self.size}], got {self.num_holes}")


def generate_solution(size: int, rng: random.Random) -> list[list[int]]:
    box = math.isqrt(size)
    digits = list(range(1, size + 1))
    rng.shuffle(digits)

    def order() -> list[int]:
        bands = list(range(box))
        rng.shuffle(bands)
        out: list[int] = []
        for band in bands:
            inner = list(range(box))
            rng.shuffle(inner)
            out.extend(band * box + i for i in inner)
        return out

    rows, cols = order(), order()
    return [[digits[(box * (r % box) + r // box + c) % size] for c in cols] for r in rows]


def is_valid_solution(grid: list[list[int]]) -> bool:
    n, box = len(grid), math.isqrt(len(grid))
    full = set(range(1, n + 1))
    units = [set(row) for row in grid] + [
        set(col) for col in zip(*grid, strict=False)
    ]  # strict=False: a ragged grid must score as invalid, not raise
    units += [
        {grid[r][c] for r in range(br, br + box) for c in range(bc, bc + box)}
        for br in range(0, n, box)
        for bc in range(0, n, box)
    ]
    return all(unit == full for unit in units)


@ENVS.register("sudoku")
class SudokuEnv(PlanExecEnv[SudokuConfig]):
    Config = SudokuConfig
    default_agents: ClassVar[dict[str, str]] = {"planner": "planner", "executor": "sudoku_executor"}

    def __init__(self, task: Task, config: SudokuConfig) -> None:
        super().__init__(task, config)
        self.puzzle: SudokuPuzzle = task.payload
        self.grid = [list(row) for row in self.puzzle.givens]
        self.rules = (
            f"Fill the {config.size}x{config.size} Sudoku: each row, column and box must contain "
            f"1-{config.size} once. '.' is blank. Place values with lines 'row col value' (1-based)."
        )

    @classmethod
    def generate_tasks(cls, config: SudokuConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng, n, tasks = random.Random(seed), config.size, []
        for i in range(num_tasks):
            solution = generate_solution(n, rng)
            holes = set(rng.sample(range(n * n), config.num_holes))
            givens = tuple(
                tuple(0 if r * n + c in holes else solution[r][c] for c in range(n)) for r in range(n)
            )
            tasks.append(Task(f"sudoku{n}-{seed}-{i}", SudokuPuzzle(n, givens, tuple(map(tuple, solution)))))
        return tasks

    def render(self) -> str:
        return "\n".join(" ".join(str(v) if v else "." for v in row) for row in self.grid)

    def apply(self, placement: tuple[int, int, int]) -> bool:
        r, c, v = placement
        n = self.puzzle.size
        if not (1 <= r <= n and 1 <= c <= n and 1 <= v <= n) or self.puzzle.givens[r - 1][c - 1]:
            return False
        self.grid[r - 1][c - 1] = v
        return True

    def solved(self) -> bool:
        return all(all(row) for row in self.grid) and is_valid_solution(self.grid)

    def progress(self) -> float:
        blanks = [(r, c) for r, row in enumerate(self.puzzle.givens) for c, v in enumerate(row) if not v]
        return sum(self.grid[r][c] == self.puzzle.solution[r][c] for r, c in blanks) / len(blanks)
