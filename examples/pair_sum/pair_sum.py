"""Pair sum: a two-agent task written as a plugin outside the megamarl package (docs/tutorial_plugin.md).

A proposer sees a target between 0 and 18 and says one digit; a finisher sees the target and the
proposer's digit and says one digit. The team wins when the two digits add up to the target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig


@AGENTS.register("pair_sum_digit")
class DigitAgent(Agent):
    """Replies are parsed to their first digit; anything else is an invalid action."""

    system_prompt = "You are playing a number game with a partner. Answer with one digit."

    def parse(self, text: str):
        stripped = text.strip()
        return (int(stripped[0]), True) if stripped[:1].isdigit() else (None, False)


@dataclass
class PairSumConfig(EnvConfig):
    max_target: int = 18

    def __post_init__(self) -> None:
        if not 0 <= self.max_target <= 18:
            raise ValueError(f"env.kwargs.max_target must be in [0, 18], got {self.max_target}")


@ENVS.register("pair_sum")
class PairSumEnv(Env):
    Config = PairSumConfig
    agents = ("proposer", "finisher")
    default_agents: ClassVar[dict[str, str]] = {"proposer": "pair_sum_digit", "finisher": "pair_sum_digit"}

    def __init__(self, task: Task, config: PairSumConfig) -> None:
        super().__init__(task, config)
        self.target: int = task.payload
        self.digits: dict[str, int | None] = {}

    @classmethod
    def generate_tasks(cls, config: PairSumConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed)  # deterministic for (config, num_tasks, seed)
        return [Task(f"pair-sum-{seed}-{i}", rng.randint(0, config.max_target)) for i in range(num_tasks)]

    def active_agents(self) -> list[str]:
        if self.done:
            return []
        return ["proposer"] if "proposer" not in self.digits else ["finisher"]

    def observe(self, agent: str) -> str:
        if agent == "proposer":
            return f"The target is {self.target}. Say one digit; your partner adds a second one."
        said = self.digits["proposer"]
        heard = "nothing valid" if said is None else said
        return f"The target is {self.target}. Your partner said {heard}. Say one digit."

    def step(self, agent: str, action) -> StepResult:
        self.digits[agent] = action.value if action.valid else None
        if agent == "finisher":
            self.done = True
        return StepResult()

    def team_reward(self) -> float:
        a, b = self.digits.get("proposer"), self.digits.get("finisher")
        return float(a is not None and b is not None and a + b == self.target)


@ORCHESTRAS.register("relay")
class Relay(Orchestra):
    """Each agent in ``order`` takes a turn, for ``rounds`` rounds, until the env is done."""

    @dataclass
    class Config(OrchestraConfig):
        order: tuple[str, ...] = ("proposer", "finisher")
        rounds: int = 1

        def __post_init__(self) -> None:
            self.order = tuple(self.order)
            if self.rounds < 1:
                raise ValueError(f"orchestra.kwargs.rounds must be >= 1, got {self.rounds}")

    async def run(self, ctx: EpisodeContext) -> None:
        for _ in range(self.config.rounds):
            for agent in self.config.order:
                if ctx.done:
                    return
                if agent in ctx.env.active_agents():
                    await ctx.turn(agent)
