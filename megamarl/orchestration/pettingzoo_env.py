"""PettingZoo adapter: train LLM agents on PettingZoo-style envs with text observations and actions.

Two registered envs wrap a user factory ``make(seed) -> env`` (``"module:function"`` in config):

* ``pettingzoo_parallel`` (Parallel API: ``reset(seed) -> (obs, infos)``,
  ``step(actions) -> (obs, rewards, terminations, truncations, infos)``). Active agents are the
  live agents that have not acted this round; ``step(agent, action)`` buffers the action, and the
  last buffered action triggers the joint ``env.step``. Use with the ``simultaneous`` orchestra
  (all agents sample concurrently, then step).
* ``pettingzoo_aec`` (AEC API: ``agent_selection``, ``observe(agent)``, ``step(action)``,
  ``terminations``/``truncations``/``rewards``). The active agent is ``agent_selection``; dead
  agents are stepped with ``None`` internally, as the AEC protocol requires. Use with
  ``sequential``.

Text in, text out: an observation is shown as ``str(obs)`` (a game that wants a richer rendering
returns strings itself); the agent's parsed ``action.value`` is passed to the game as its action
(``invalid_action`` when the parse failed). Rewards: each agent's PettingZoo rewards are summed
over the episode (AEC: ``rewards`` is read after every ``step``, i.e. it must hold the rewards of
the latest step, the PettingZoo convention); that sum is the agent's local reward
(``agent_reward``), and the team reward is the sum over agents (cooperative games; competitive
users read local rewards).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task


def _resolve(factory: str) -> Callable[[int], Any]:
    module, sep, name = factory.partition(":")
    if not sep:
        raise ValueError(f"env.factory must be 'module:function', got {factory!r}")
    return getattr(importlib.import_module(module), name)


@dataclass
class PettingZooConfig(EnvConfig):
    factory: str = ""  # "module:function", called with the episode seed
    invalid_action: Any = None  # passed to the game when an agent's reply does not parse
    max_cycles: int = 100

    def __post_init__(self) -> None:
        if not self.factory:
            raise ValueError("env.factory must name a 'module:function' that builds the PettingZoo env")
        _resolve(self.factory)  # fail at config time, not in the first episode
        if self.max_cycles < 1:
            raise ValueError(f"env.max_cycles must be >= 1, got {self.max_cycles}")


class _PettingZooBase(Env):
    Config = PettingZooConfig

    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.game = _resolve(config.factory)(task.payload)
        self.totals: dict[str, float] = {a: 0.0 for a in self.game.possible_agents}
        self.agents = tuple(self.game.possible_agents)
        self.num_cycles = 0

    @classmethod
    def generate_tasks(cls, config: PettingZooConfig, *, num_tasks: int, seed: int) -> list[Task]:
        return [Task(f"pz-{seed}-{i}", seed * 100_003 + i) for i in range(num_tasks)]

    def _add_rewards(self, rewards: dict[str, float]) -> None:
        for agent, reward in rewards.items():
            self.totals[agent] = self.totals.get(agent, 0.0) + float(reward)

    def _value(self, action) -> Any:
        return action.value if action.valid else self.config.invalid_action

    def agent_reward(self, agent: str) -> float | None:
        return self.totals.get(agent)

    def team_reward(self) -> float:
        return sum(self.totals.values())

    def success(self) -> bool:
        return self.team_reward() > 0


@ENVS.register("pettingzoo_parallel")
class PettingZooParallel(_PettingZooBase):
    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.observations, _ = self.game.reset(seed=task.payload)
        self.pending: dict[str, Any] = {}

    def active_agents(self) -> list[str]:
        if self.done:
            return []
        return [a for a in self.game.agents if a not in self.pending]

    def observe(self, agent: str) -> str:
        return str(self.observations[agent])

    def step(self, agent: str, action) -> StepResult:
        self.pending[agent] = self._value(action)
        if any(a not in self.pending for a in self.game.agents):
            return StepResult()
        self.observations, rewards, _, _, _ = self.game.step(self.pending)
        self.pending = {}
        self._add_rewards(rewards)
        self.num_cycles += 1
        self.done = not self.game.agents or self.num_cycles >= self.config.max_cycles
        return StepResult()


@ENVS.register("pettingzoo_aec")
class PettingZooAEC(_PettingZooBase):
    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.game.reset(seed=task.payload)
        self._skip_dead()

    def _dead(self, agent: str) -> bool:
        return self.game.terminations.get(agent, False) or self.game.truncations.get(agent, False)

    def _skip_dead(self) -> None:
        while self.game.agents and self._dead(self.game.agent_selection):
            self.game.step(None)
            self._add_rewards(self.game.rewards)
        self.done = not self.game.agents or self.num_cycles >= self.config.max_cycles

    def active_agents(self) -> list[str]:
        return [] if self.done else [self.game.agent_selection]

    def observe(self, agent: str) -> str:
        return str(self.game.observe(agent))

    def step(self, agent: str, action) -> StepResult:
        if agent != self.game.agent_selection:
            raise ValueError(f"AEC env expected '{self.game.agent_selection}' to act, got '{agent}'")
        self.game.step(self._value(action))
        self._add_rewards(self.game.rewards)
        self.num_cycles += 1
        self._skip_dead()
        return StepResult()
