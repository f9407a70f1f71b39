"""Tiny PettingZoo-API text games: examples of wrapping a PettingZoo env (docs/pettingzoo.md).

``EchoParallelGame`` (parallel API; the ``configs/presets/task/pettingzoo.yaml`` task: each round both
players must say the word they are shown) and ``CountingAECGame`` (AEC API with a numeric
observation, rendered as text by ``render_count``). They subclass pettingzoo's bases when it is
installed; the adapters (``pettingzoo``, ``pettingzoo_text``) need only the API.
"""

from __future__ import annotations

import string
from typing import Any, ClassVar

import numpy as np

try:
    from gymnasium import spaces as _spaces
    from pettingzoo import AECEnv as _AECBase
    from pettingzoo import ParallelEnv as _ParallelBase
except ImportError:  # the adapter only needs the API, not the package
    _spaces, _AECBase, _ParallelBase = None, object, object  # type: ignore[assignment]  # stand-ins

WORDS = ("red", "green", "blue")
TEXT_CHARSET = string.ascii_letters + string.digits + " .:"


class EchoParallelGame(_ParallelBase):
    """Parallel API. Each round every agent is shown a word and must say it; reward 1 per agent that
    does. Two rounds, then truncation. The word for (round, agent) is fixed by the seed."""

    metadata: ClassVar[dict[str, Any]] = {"name": "echo_parallel_v0"}

    def __init__(self, num_rounds: int = 2) -> None:
        self.possible_agents = ["alice", "bob"]
        self.num_rounds = num_rounds
        if _spaces is not None:
            self.observation_spaces = {
                a: _spaces.Text(64, charset=TEXT_CHARSET) for a in self.possible_agents
            }
            self.action_spaces = {a: _spaces.Text(16, charset=TEXT_CHARSET) for a in self.possible_agents}

    def observation_space(self, agent):
        return self.observation_spaces[agent]

    def action_space(self, agent):
        return self.action_spaces[agent]

    def _word(self, agent: str) -> str:
        return WORDS[(self.seed + self.round + self.possible_agents.index(agent)) % len(WORDS)]

    def _obs(self) -> dict[str, str]:
        return {a: f"Round {self.round}. Say the word: {self._word(a)}" for a in self.agents}

    def reset(self, seed: int | None = None, options=None):
        self.seed, self.round = seed or 0, 0
        self.agents = list(self.possible_agents)
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]):
        rewards = {a: float(str(actions[a]).strip().lower() == self._word(a)) for a in self.agents}
        self.round += 1
        over = self.round >= self.num_rounds
        terminations = {a: False for a in self.agents}
        truncations = {a: over for a in self.agents}
        infos: dict[str, dict[str, Any]] = {a: {} for a in self.agents}
        if over:
            self.agents = []
        return self._obs(), rewards, terminations, truncations, infos


class CountingAECGame(_AECBase):
    """AEC API. Agents take turns saying the next integer after the current count; a correct number
    earns 1 and advances the count, a wrong one ends the game for everyone (terminated). The game
    ends after ``target`` correct counts. The count starts at ``seed % 5``. Observations are numpy
    arrays ``[count]`` (PettingZoo's ``api_test`` requires numpy observations); ``render_count`` is
    the game's text hook (``env.kwargs.render``)."""

    metadata: ClassVar[dict[str, Any]] = {"name": "counting_aec_v0"}

    def __init__(self, target: int = 4) -> None:
        super().__init__()
        self.possible_agents = ["p0", "p1"]
        self.target = target
        if _spaces is not None:
            # the charset must cover the observation text, or the observation is out of its space
            self.observation_spaces = {a: _spaces.Box(0, 100, (1,), np.int64) for a in self.possible_agents}
            self.action_spaces = {a: _spaces.Discrete(100) for a in self.possible_agents}

    def observation_space(self, agent):
        return self.observation_spaces[agent]

    def action_space(self, agent):
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options=None):
        self.agents = list(self.possible_agents)
        self.count, self.num_correct = (seed or 0) % 5, 0
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos: dict[str, dict[str, Any]] = {a: {} for a in self.agents}
        self.agent_selection = self.agents[0]

    def observe(self, agent: str) -> np.ndarray:
        return np.array([self.count], dtype=np.int64)

    def step(self, action) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)  # the AEC "dead step": remove the agent, clear rewards
            return
        self.rewards = {a: 0.0 for a in self.agents}
        correct = action is not None and int(action) == self.count + 1
        if correct:
            self.count += 1
            self.num_correct += 1
            self.rewards[agent] = 1.0
        if not correct or self.num_correct >= self.target:
            self.terminations = {a: True for a in self.agents}
        self._accumulate_rewards()
        self.agent_selection = self.agents[(self.agents.index(agent) + 1) % len(self.agents)]


def make_echo_parallel(seed: int) -> EchoParallelGame:
    return EchoParallelGame()


def make_counting_aec(seed: int) -> CountingAECGame:
    return CountingAECGame()


def render_count(obs: np.ndarray, agent: str) -> str:
    return f"The count is {int(obs[0])}. Say the next number."
