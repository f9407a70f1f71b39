"""Test doubles for orchestration: a scripted Engine, faulty envs, tiny PettingZoo-API text games.

``ScriptedEngine`` implements the ``Engine`` protocol with a Python function instead of a model:
``policy(request) -> reply text``. The reply is tokenized with the policy's tokenizer, truncated
to ``max_tokens`` (finish "length") or terminated with EOS (finish "stop", EOS included in the
ids like a real engine), and given fake logprobs (-0.5 each). Every request is recorded, so tests
can check that ``prompt_ids`` are exactly what the engine saw.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import string
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.rollout.base import Engine, Generation, SamplingParams


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The packaged real model's tokenizer (ChatML template, eos ``<|im_end|>``), loaded once."""
    from transformers import AutoTokenizer

    from megamarl.models.packaged import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


@dataclass
class ScriptedRequest:
    prompt_text: str  # the decoded prompt (special tokens kept)
    prompt_ids: list[int]
    index: int  # candidate index in [0, n)
    lora: str | None

    @property
    def last_user(self) -> str:
        """The content of the last user turn of a ChatML prompt."""
        turns = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", self.prompt_text, re.DOTALL)
        return turns[-1] if turns else self.prompt_text

    @property
    def system(self) -> str:
        found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", self.prompt_text, re.DOTALL)
        return found.group(1) if found else ""


class ScriptedEngine(Engine):
    def __init__(
        self, tokenizer: Any, policy: Callable[[ScriptedRequest], str], *, weight_version: int = 0,
        delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.weight_version = weight_version
        self.delay_s = delay_s
        self.requests: list[tuple[list[int], SamplingParams, str | None]] = []
        self.replies: list[list[int]] = []

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        self.requests.append((list(prompt_ids), sampling, lora))
        await asyncio.sleep(self.delay_s)  # yield: concurrent episodes interleave like with a real engine
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        out = []
        for index in range(sampling.n):
            text = self.policy(ScriptedRequest(prompt_text, list(prompt_ids), index, lora))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= sampling.max_tokens:
                ids, reason = ids[: sampling.max_tokens], "length"
            else:
                ids, reason = ids + [eos], "stop"
            self.replies.append(ids)
            out.append(Generation(ids, [-0.5] * len(ids), reason, self.weight_version))
        return out

    def update_weights(self, weights: Iterable, *, version: int, lora: str | None = None) -> None:
        self.weight_version = version


def fixed(reply: str) -> Callable[[ScriptedRequest], str]:
    return lambda request: reply


# -- faulty envs (module-level so env worker processes can unpickle them) --------------------------


@dataclass
class FaultyConfig(EnvConfig):
    fault: str = "none"  # none | crash | hang | raise

    def __post_init__(self) -> None:
        if self.fault not in ("none", "crash", "hang", "raise"):
            raise ValueError(f"env.fault must be none|crash|hang|raise, got {self.fault!r}")


@ENVS.register("testing_faulty")
class FaultyEnv(Env):
    """One agent ``actor``; its step crashes the worker, hangs, raises, or ends with reward 1.
    ``payload`` of a task overrides the fault, so one run can mix good and bad episodes."""

    Config = FaultyConfig
    agents = ("actor",)
    default_agents: ClassVar[dict[str, str]] = {"actor": "text"}
    remote_step = True

    @classmethod
    def generate_tasks(cls, config: FaultyConfig, *, num_tasks: int, seed: int) -> list[Task]:
        return [Task(f"faulty-{seed}-{i}", config.fault) for i in range(num_tasks)]

    def observe(self, agent: str) -> str:
        return "Say anything."

    def step(self, agent: str, action) -> StepResult:
        fault = self.task.payload
        if fault == "crash":
            os._exit(13)
        if fault == "hang":
            time.sleep(3600)
        if fault == "raise":
            raise RuntimeError("env bug")
        self.done = True
        return StepResult(local_reward=0.5)

    def team_reward(self) -> float:
        return 1.0 if self.done else 0.0


# -- tiny PettingZoo-API text games (subclassing pettingzoo's bases when it is installed) -----------

try:
    from gymnasium import spaces as _spaces
    from pettingzoo import AECEnv as _AECBase
    from pettingzoo import ParallelEnv as _ParallelBase
except ImportError:  # the adapter only needs the API, not the package
    _spaces, _AECBase, _ParallelBase = None, object, object

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
            self.observation_spaces = {a: _spaces.Text(64, charset=TEXT_CHARSET) for a in self.possible_agents}
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
        infos = {a: {} for a in self.agents}
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
        self.infos = {a: {} for a in self.agents}
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


def map_to_gamma(agent_id: str, episode_seed: int) -> str:
    """A ``rollout.policy_mapping`` naming an undefined policy (config validation tests)."""
    return "gamma"
