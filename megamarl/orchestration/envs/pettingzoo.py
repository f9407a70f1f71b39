"""PettingZoo adapter: train LLM agents on PettingZoo games (text in, text out).

Two registered envs wrap a user factory ``make(seed) -> env`` (``env.kwargs.factory``,
``"module:function"``): ``pettingzoo_parallel`` (Parallel API; the last active agent's action
triggers the joint ``env.step``; use the ``simultaneous`` orchestra) and ``pettingzoo_aec`` (AEC API;
the active agent is ``agent_selection``; use ``sequential``). Text hooks ``render(obs, agent) -> str``
and ``parse(text, agent) -> action`` (``env.kwargs``; defaults in ``pettingzoo_text``) turn
observations into text and replies into actions. An illegal action marks its sample invalid and
``invalid_outcome`` decides what the game sees (``lose``, ``random`` or ``pass``). Each agent's
summed PettingZoo rewards are its local reward; ``scoring: team`` sums them into the team reward,
``scoring: competitive`` has none and an agent succeeds when it wins. Details:
docs/design-notes.md, "megamarl/orchestration/envs/pettingzoo.py".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megamarl.orchestration.context import derive_seed
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.orchestration.envs.pettingzoo_text import (
    InvalidAction,
    action_mask,
    is_legal,
    parse_action,
    random_legal,
    render_observation,
)
from megamarl.registry import resolve_callable

INVALID_OUTCOMES = ("lose", "random", "pass")
SCORINGS = ("team", "competitive")


@dataclass
class PettingZooConfig(EnvConfig):
    factory: str = ""  # "module:function", called with the episode seed
    render: str = ""  # "module:function" (obs, agent) -> str; empty: pettingzoo_text default
    parse: str = ""  # "module:function" (text, agent) -> action; empty: default for the action space
    invalid_outcome: str = "lose"  # lose | random | pass (see the module docstring)
    invalid_reward: float = -1.0  # lose: added to the offender's return
    invalid_action: Any = None  # pass: what the game receives
    scoring: str = "team"  # team | competitive
    max_cycles: int = 100

    def __post_init__(self) -> None:
        if not self.factory:
            raise ValueError(
                "env.kwargs.factory must name a 'module:function' that builds the PettingZoo env"
            )
        # resolve at config time, not in the first episode
        for key in ("factory", "render", "parse"):
            if getattr(self, key):
                resolve_callable(getattr(self, key), key=f"env.kwargs.{key}")
        if self.invalid_outcome not in INVALID_OUTCOMES:
            raise ValueError(
                f"env.kwargs.invalid_outcome={self.invalid_outcome!r}; allowed: {list(INVALID_OUTCOMES)}"
            )
        if self.scoring not in SCORINGS:
            raise ValueError(f"env.kwargs.scoring={self.scoring!r}; allowed: {list(SCORINGS)}")
        if self.max_cycles < 1:
            raise ValueError(f"env.kwargs.max_cycles must be >= 1, got {self.max_cycles}")


class _PettingZooBase(Env[PettingZooConfig]):
    Config = PettingZooConfig

    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.game = resolve_callable(config.factory, key="env.kwargs.factory")(task.payload)
        self.agents = tuple(self.game.possible_agents)
        self.totals: dict[str, float] = {a: 0.0 for a in self.agents}
        self.num_cycles = 0
        self._render: Callable = _hook(config.render, "render") or self._default_render
        self._parse: Callable = _hook(config.parse, "parse") or self._default_parse

    @classmethod
    def generate_tasks(cls, config: PettingZooConfig, *, num_tasks: int, seed: int) -> list[Task]:
        return [Task(f"pz-{seed}-{i}", seed * 100_003 + i) for i in range(num_tasks)]

    # -- subclasses: the game's current raw observation and info of ``agent`` -------------------------
    def _raw(self, agent: str) -> tuple[Any, dict]:
        raise NotImplementedError

    def observe(self, agent: str) -> str:
        return self._render(self._raw(agent)[0], agent)

    def _default_render(self, obs: Any, agent: str) -> str:
        return render_observation(obs)

    def _default_parse(self, text: str, agent: str) -> Any:
        return parse_action(text, self.game.action_space(agent))

    def _game_action(self, agent: str, action) -> tuple[Any, bool]:
        """(what the game receives, legal). None as the first item: the offender forfeits."""
        space = self.game.action_space(agent)
        obs, info = self._raw(agent)
        mask = action_mask(obs, info)
        try:
            if not action.valid:
                raise InvalidAction("the agent's parser rejected the reply")
            value = self._parse(action.text, agent)
            if not is_legal(value, space, mask):
                raise InvalidAction(f"{value!r} is masked out")
            return value, True
        except (InvalidAction, ValueError, IndexError):
            pass
        outcome = self.config.invalid_outcome
        if outcome == "pass":
            return self.config.invalid_action, False
        if outcome == "random":
            return random_legal(space, mask, derive_seed(self.task.payload, agent, self.num_cycles)), False
        self.totals[agent] += self.config.invalid_reward
        self.done = True
        return None, False

    def _add_rewards(self, rewards: dict[str, float]) -> None:
        for agent, reward in rewards.items():
            self.totals[agent] = self.totals.get(agent, 0.0) + float(reward)

    def agent_reward(self, agent: str) -> float | None:
        return self.totals.get(agent)

    def team_reward(self) -> float:
        return 0.0 if self.config.scoring == "competitive" else sum(self.totals.values())

    def agent_success(self, agent: str) -> bool | None:
        own = self.totals.get(agent, 0.0)
        if self.config.scoring == "team":
            return own > 0
        return all(own > other for a, other in self.totals.items() if a != agent)

    def success(self) -> bool:
        if self.config.scoring == "team":
            return self.team_reward() > 0
        return any(self.agent_success(a) for a in self.totals)


def _hook(spec: str, name: str) -> Callable | None:
    return resolve_callable(spec, key=f"env.kwargs.{name}") if spec else None


@ENVS.register("pettingzoo_parallel")
class PettingZooParallel(_PettingZooBase):
    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.observations, self.infos = self.game.reset(seed=task.payload)
        self.pending: dict[str, Any] = {}

    def _raw(self, agent: str) -> tuple[Any, dict]:
        return self.observations[agent], (self.infos or {}).get(agent, {})

    def active_agents(self) -> list[str]:
        if self.done:
            return []
        return [a for a in self.game.agents if a not in self.pending]

    def step(self, agent: str, action) -> StepResult:
        value, legal = self._game_action(agent, action)
        if self.done:  # forfeited: the joint step never happens
            return StepResult(invalid=True)
        self.pending[agent] = value
        if any(a not in self.pending for a in self.game.agents):
            return StepResult(invalid=not legal)
        self.observations, rewards, _, _, self.infos = self.game.step(self.pending)
        self.pending = {}
        self._add_rewards(rewards)
        self.num_cycles += 1
        self.done = not self.game.agents or self.num_cycles >= self.config.max_cycles
        return StepResult(invalid=not legal)


@ENVS.register("pettingzoo_aec")
class PettingZooAEC(_PettingZooBase):
    def __init__(self, task: Task, config: PettingZooConfig) -> None:
        super().__init__(task, config)
        self.game.reset(seed=task.payload)
        self._skip_dead()

    def _raw(self, agent: str) -> tuple[Any, dict]:
        return self.game.observe(agent), self.game.infos.get(agent, {})

    def _dead(self, agent: str) -> bool:
        return self.game.terminations.get(agent, False) or self.game.truncations.get(agent, False)

    def _skip_dead(self) -> None:
        while self.game.agents and self._dead(self.game.agent_selection):
            self.game.step(None)
            self._add_rewards(self.game.rewards)
        self.done = self.done or not self.game.agents or self.num_cycles >= self.config.max_cycles

    def active_agents(self) -> list[str]:
        return [] if self.done else [self.game.agent_selection]

    def step(self, agent: str, action) -> StepResult:
        if agent != self.game.agent_selection:
            raise ValueError(f"AEC env expected '{self.game.agent_selection}' to act, got '{agent}'")
        value, legal = self._game_action(agent, action)
        if self.done:  # forfeited
            return StepResult(invalid=True)
        self.game.step(value)
        self._add_rewards(self.game.rewards)
        self.num_cycles += 1
        self._skip_dead()
        return StepResult(invalid=not legal)
