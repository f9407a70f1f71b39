"""Planning games with a planner and an executor: grid path planning and small Sokoban levels
(Sudoku lives in ``sudoku.py`` on the same base).

The planner writes a free-text plan; the executor replies with moves (``U D L R`` or the words),
applied in order until solved or ``max_actions`` is spent. Use the ``sequential`` orchestra.
Transitions are exact and deterministic; a blocked move is a no-op that costs an action
(``num_blocked``). Team reward = 1 if solved. ``score`` (the tree-sampling check fn) applies the
executor's actions to a copy and returns progress in [0, 1]. Levels are generated from a seed and
solvable by construction (grids: BFS-checked walls; Sokoban: reverse pulls from the goals).
Details: docs/design-notes.md, "megamarl/orchestration/envs/planning.py".
"""

from __future__ import annotations

import abc
import copy
import random
import re
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task

Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_WORDS = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R"}


def parse_moves(text: str) -> tuple[list[str], bool]:
    """Moves from words (up/down/...) or runs of the letters U/D/L/R ("RRDD"); other words ignored."""
    moves: list[str] = []
    for word in re.findall(r"[A-Za-z]+", text):
        upper = word.upper()
        if upper in _WORDS:
            moves.append(_WORDS[upper])
        elif word.isupper() and set(upper) <= set(MOVES):
            moves.extend(upper)
    return moves, bool(moves)


@AGENTS.register("planner")
class Planner(Agent):
    system_prompt = "You plan solutions to puzzles step by step."


@AGENTS.register("move_executor")
class MoveExecutor(Agent):
    system_prompt = "You execute plans in a grid puzzle. Reply only with moves U, D, L or R."

    def parse(self, text: str):
        return parse_moves(text)


@dataclass
class PlanningConfig(EnvConfig):
    max_actions: int = 32  # primitive actions per episode

    def __post_init__(self) -> None:
        if self.max_actions < 1:
            raise ValueError(f"env.max_actions must be >= 1, got {self.max_actions}")


PlanningConfigT = TypeVar("PlanningConfigT", bound=PlanningConfig)


class PlanExecEnv(Env[PlanningConfigT]):
    """Shared planner/executor protocol; subclasses implement the game."""

    agents = ("planner", "executor")
    rules = ""

    def __init__(self, task: Task, config: PlanningConfigT) -> None:
        super().__init__(task, config)
        self.plan = ""
        self.num_actions = 0
        self.num_blocked = 0

    @abc.abstractmethod
    def render(self) -> str: ...

    @abc.abstractmethod
    def apply(self, primitive) -> bool:
        """Apply one primitive action; False if it was blocked/invalid (state unchanged)."""

    @abc.abstractmethod
    def solved(self) -> bool: ...

    @abc.abstractmethod
    def progress(self) -> float: ...

    def observe(self, agent: str) -> str:
        if agent == "planner":
            return f"{self.rules}\n\n{self.render()}\nWrite a short plan."
        plan = self.plan or "(none)"
        return f"{self.rules}\n\n{self.render()}\nPlan: {plan}\nReply with your next actions."

    def step(self, agent: str, action) -> StepResult:
        if agent == "planner":
            self.plan = action.text.strip()
            return StepResult()
        for primitive in action.value if action.valid else []:
            if self.done:
                break
            self.num_blocked += not self.apply(primitive)
            self.num_actions += 1
            self.done = self.solved() or self.num_actions >= self.config.max_actions
        return StepResult(local_reward=self.progress())

    def score(self, agent: str, action) -> float | None:
        if agent != "executor":
            return None
        trial = copy.deepcopy(self)
        trial.step(agent, action)
        return trial.progress()

    def team_reward(self) -> float:
        return float(self.solved())


# -- grid path planning -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GridLevel:
    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell


def bfs_distances(size: int, walls: frozenset[Cell], source: Cell) -> dict[Cell, int]:
    dist = {source: 0}
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


@dataclass
class GridConfig(PlanningConfig):
    size: int = 5
    wall_prob: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 3 <= self.size <= 12:
            raise ValueError(f"env.size must be in [3, 12], got {self.size}")
        if not 0 <= self.wall_prob < 0.6:
            raise ValueError(f"env.wall_prob must be in [0, 0.6), got {self.wall_prob}")


@ENVS.register("grid")
class GridEnv(PlanExecEnv[GridConfig]):
    Config = GridConfig
    default_agents: ClassVar[dict[str, str]] = {"planner": "planner", "executor": "move_executor"}
    rules = "Move the agent A to the goal G on the grid. # is a wall, . is free. Moves: U D L R."

    def __init__(self, task: Task, config: GridConfig) -> None:
        super().__init__(task, config)
        self.level: GridLevel = task.payload
        self.pos = self.level.start
        self._dist = bfs_distances(self.level.size, self.level.walls, self.level.goal)

    @classmethod
    def generate_tasks(cls, config: GridConfig, *, num_tasks: int, seed: int) -> list[Task]:
        tasks: list[Task]
        rng, n, tasks = random.Random(seed), config.size, []
        while len(tasks) < num_tasks:
            cells = [(r, c) for r in range(n) for c in range(n)]
            start, goal = rng.sample(cells, 2)
            walls = frozenset(x for x in cells if x not in (start, goal) and rng.random() < config.wall_prob)
            if start in bfs_distances(n, walls, goal):
                tasks.append(Task(f"grid-{seed}-{len(tasks)}", GridLevel(n, walls, start, goal)))
        return tasks

    def render(self) -> str:
        def char(cell: Cell) -> str:
            if cell == self.pos:
                return "A"
            return "G" if cell == self.level.goal else "#" if cell in self.level.walls else "."

        n = self.level.size
        return "\n".join("".join(char((r, c)) for c in range(n)) for r in range(n))

    def apply(self, move: str) -> bool:
        dr, dc = MOVES[move]
        nxt = (self.pos[0] + dr, self.pos[1] + dc)
        if not (0 <= nxt[0] < self.level.size and 0 <= nxt[1] < self.level.size) or nxt in self.level.walls:
            return False
        self.pos = nxt
        return True

    def solved(self) -> bool:
        return self.pos == self.level.goal

    def progress(self) -> float:
        return 1.0 - self._dist[self.pos] / self._dist[self.level.start]


# -- Sokoban ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SokobanLevel:
    height: int
    width: int
    walls: frozenset[Cell]
    goals: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell


@dataclass
class SokobanConfig(PlanningConfig):
    size: int = 6  # outer size including the wall border
    num_boxes: int = 1
    num_reverse_moves: int = 12

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 5 <= self.size <= 10:
            raise ValueError(f"env.size must be in [5, 10], got {self.size}")
        if not 1 <= self.num_boxes <= 3:
            raise ValueError(f"env.num_boxes must be in [1, 3], got {self.num_boxes}")
        if self.num_reverse_moves < 1:
            raise ValueError(f"env.num_reverse_moves must be >= 1, got {self.num_reverse_moves}")


def _reverse_play(rng: random.Random, config: SokobanConfig) -> SokobanLevel | None:
    n = config.size
    walls = frozenset((r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1))
    floor = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
    picks = rng.sample(floor, config.num_boxes + 1)
    goals, player = frozenset(picks[:-1]), picks[-1]
    boxes = set(goals)
    for _ in range(config.num_reverse_moves):
        dr, dc = rng.choice(list(MOVES.values()))
        nxt = (player[0] + dr, player[1] + dc)
        if nxt in walls or nxt in boxes:
            continue
        behind = (player[0] - dr, player[1] - dc)
        if behind in boxes and rng.random() < 0.8:  # pull: the box follows the player
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
    if boxes == set(goals):
        return None
    return SokobanLevel(n, n, walls, goals, frozenset(boxes), player)


@ENVS.register("sokoban")
class SokobanEnv(PlanExecEnv[SokobanConfig]):
    Config = SokobanConfig
    default_agents: ClassVar[dict[str, str]] = {"planner": "planner", "executor": "move_executor"}
    rules = (
        "Sokoban: push every box onto a goal. # wall, _ floor, @ you, $ box, . goal, * box on goal, "
        "+ you on goal. You push a box by walking into it; you cannot pull. Moves: U D L R."
    )

    def __init__(self, task: Task, config: SokobanConfig) -> None:
        super().__init__(task, config)
        self.level: SokobanLevel = task.payload
        self.player = self.level.player
        self.boxes = set(self.level.boxes)

    @classmethod
    def generate_tasks(cls, config: SokobanConfig, *, num_tasks: int, seed: int) -> list[Task]:
        tasks: list[Task]
        rng, tasks = random.Random(seed), []
        while len(tasks) < num_tasks:
            level = _reverse_play(rng, config)
            if level is not None:
                tasks.append(Task(f"sokoban-{seed}-{len(tasks)}", level))
        return tasks

    def render(self) -> str:
        rows = []
        for r in range(self.level.height):
            row = ""
            for c in range(self.level.width):
                cell, goal = (r, c), (r, c) in self.level.goals
                if cell in self.level.walls:
                    row += "#"
                elif cell in self.boxes:
                    row += "*" if goal else "$"
                elif cell == self.player:
                    row += "+" if goal else "@"
                else:
                    row += "." if goal else "_"
            rows.append(row)
        return "\n".join(rows)

    def apply(self, move: str) -> bool:
        dr, dc = MOVES[move]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if nxt in self.level.walls:
            return False
        if nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.level.walls or beyond in self.boxes:
                return False
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
        self.player = nxt
        return True

    def solved(self) -> bool:
        return self.boxes == set(self.level.goals)

    def progress(self) -> float:
        return len(self.boxes & self.level.goals) / len(self.level.goals)
