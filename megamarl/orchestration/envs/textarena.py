"""TextArena adapter: TextArena's multi-player text games (PyPI ``textarena``) as multi-agent envs.

``textarena`` (registered env) plays one TextArena game per episode through TextArena's own API:
``ta.make(game, **game_kwargs)``, ``reset(num_players, seed=<episode seed>)``, ``get_observation()``
(the current player and its text; TextArena's wrappers decide what it shows), ``step(reply)`` and
``close()`` (the rewards). Each player is an agent (roles ``player_0``..``player_<n-1>`` or
``env.kwargs.players``); the only active agent is TextArena's current player, so the ``sequential``
orchestra plays the game in TextArena's turn order. A move TextArena calls invalid (its
``set_invalid_move``: a retry, or a forfeit once the game's allowance is spent) marks the sample
invalid; the game's own rules decide what follows. Scoring is competitive: no team reward, each agent
trains on its own TextArena reward (0 for a game the orchestra cut short), and it succeeds when it
won (a positive reward that no player beats). TextArena games draw from the global ``random`` and
``numpy.random``; each episode keeps its own state of both, so interleaved episodes and the driver
do not disturb one another. ``textarena`` is imported only when a game is built.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megamarl.orchestration.action import Action
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task

EXTRA_HINT = "pip install 'megamarl[textarena]' (or bash scripts/setup.sh --extras textarena)"


@dataclass
class TextArenaConfig(EnvConfig):
    game: str = ""  # a TextArena env id, e.g. TicTacToe-v0 (its wrappers: -train, -raw variants)
    game_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to ta.make(game, **game_kwargs)
    num_players: int = 2
    players: list[str] = field(default_factory=list)  # role of each player id; empty: player_<id>

    def __post_init__(self) -> None:
        if not self.game:
            raise ValueError("env.kwargs.game must name a TextArena env id, e.g. TicTacToe-v0")
        if importlib.util.find_spec("textarena") is None:
            raise ValueError(
                f"env 'textarena' (env.kwargs.game={self.game}) needs the 'textarena' package, which is "
                f"not importable here: {EXTRA_HINT}"
            )
        if self.num_players < 1:
            raise ValueError(f"env.kwargs.num_players must be >= 1, got {self.num_players}")
        self.players = [str(p) for p in self.players]
        if self.players and len(self.players) != self.num_players:
            raise ValueError(
                f"env.kwargs.players names {len(self.players)} roles {self.players}, but "
                f"env.kwargs.num_players={self.num_players}; name one role per player"
            )
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"env.kwargs.players must be distinct, got {self.players}")
        self.game_kwargs = dict(self.game_kwargs)
        registry = _textarena_registry()
        if self.game not in registry:
            close = difflib.get_close_matches(self.game, list(registry), n=3)
            raise ValueError(
                f"env.kwargs.game={self.game!r} is not a registered TextArena env"
                + (f"; did you mean {close}?" if close else "")
            )

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.players) or tuple(f"player_{i}" for i in range(self.num_players))


def _textarena() -> Any:
    return importlib.import_module("textarena")


def _textarena_registry() -> dict[str, Any]:
    return importlib.import_module("textarena.envs.registration").ENV_REGISTRY


@ENVS.register("textarena")
class TextArenaEnv(Env[TextArenaConfig]):
    Config = TextArenaConfig

    def __init__(self, task: Task, config: TextArenaConfig) -> None:
        super().__init__(task, config)
        self.agents = config.roles
        self._random_state = random.Random(task.payload).getstate()
        self._np_random_state = np.random.RandomState(task.payload % 2**32).get_state()
        self.rewards: dict[str, float] = {}  # filled when the game ends
        self.num_turns = 0
        self.num_invalid = 0
        with self._own_random():
            self.game = _textarena().make(config.game, **config.game_kwargs)
            self.game.reset(num_players=config.num_players, seed=task.payload)
            self._observe_current()

    @classmethod
    def generate_tasks(cls, config: TextArenaConfig, *, num_tasks: int, seed: int) -> list[Task]:
        return [Task(f"ta-{seed}-{i}", seed * 100_003 + i) for i in range(num_tasks)]

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run TextArena code on this episode's own ``random`` / ``numpy.random`` state."""
        outer, np_outer = random.getstate(), np.random.get_state()
        random.setstate(self._random_state)
        np.random.set_state(self._np_random_state)
        try:
            yield
        finally:
            self._random_state, self._np_random_state = random.getstate(), np.random.get_state()
            random.setstate(outer)
            np.random.set_state(np_outer)

    def _observe_current(self) -> None:
        # get_observation() hands out (and clears) the current player's pending messages: read once
        player_id, observation = self.game.get_observation()
        self.current = self.agents[player_id]
        self.observation = observation if isinstance(observation, str) else str(observation)

    def active_agents(self) -> list[str]:
        return [] if self.done else [self.current]

    def observe(self, agent: str) -> str:
        if agent != self.current:
            raise ValueError(f"TextArena game {self.config.game}: '{self.current}' acts now, not '{agent}'")
        return self.observation

    def step(self, agent: str, action: Action) -> StepResult:
        if self.done or agent != self.current:
            raise ValueError(
                f"TextArena game {self.config.game}: '{agent}' cannot act now "
                f"({'the game is over' if self.done else repr(self.current) + ' acts now'})"
            )
        player_id = self.agents.index(agent)
        state = self.game.state
        forfeited_before = bool(state.game_info[player_id].get("invalid_move"))
        reply = str(action.value) if action.valid and action.value is not None else action.text
        with self._own_random():
            done, _ = self.game.step(reply)
            # TextArena's set_invalid_move: a retry leaves error_count > 0 (the same player moves
            # again), a forfeit sets game_info[player]["invalid_move"]
            invalid = getattr(state, "error_count", 0) > 0 or (
                bool(state.game_info[player_id].get("invalid_move")) and not forfeited_before
            )
            if done:
                rewards, _ = self.game.close()
                self.rewards = {self.agents[pid]: float(r) for pid, r in (rewards or {}).items()}
                self.done = True
            else:
                self._observe_current()
        self.num_turns += 1
        self.num_invalid += invalid
        return StepResult(invalid=invalid or not action.valid)

    def team_reward(self) -> float:
        return 0.0  # competitive: each agent trains on its own reward (agent_reward)

    def agent_reward(self, agent: str) -> float | None:
        return self.rewards.get(agent, 0.0)

    def agent_success(self, agent: str) -> bool | None:
        own = self.rewards.get(agent, 0.0)
        return own > 0 and all(own >= other for other in self.rewards.values())

    def success(self) -> bool:
        return any(self.agent_success(a) for a in self.agents)

    def metrics(self) -> dict[str, float]:
        return {
            "turns": float(self.num_turns),
            "invalid_moves": float(self.num_invalid),
            "unfinished": 0.0 if self.done else 1.0,  # cut by the orchestra's budget before the game ended
        }


def _seat(agent_id: str) -> int:
    """The player id of a default role name (``player_<id>``)."""
    return int(agent_id.rsplit("_", 1)[-1])


def learner_vs_pool(agent_id: str, episode_seed: int) -> str:
    """``rollout.policy_mapping`` for two players against ``rollout.opponent_pool``: policy ``alpha``
    plays player 0 or player 1 by the episode seed's parity, the pool's alias ``opponent`` the other."""
    return "alpha" if (episode_seed + _seat(agent_id)) % 2 == 0 else "opponent"


def alpha_vs_beta(agent_id: str, episode_seed: int) -> str:
    """``rollout.policy_mapping`` for two players and two trained policies, ``alpha`` and ``beta``,
    swapping seats by the episode seed's parity (each moves first in about half the games)."""
    return ("alpha", "beta")[(episode_seed + _seat(agent_id)) % 2]
