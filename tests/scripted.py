"""Test doubles for orchestration: a scripted Engine, faulty envs, a policy mapping for config tests.

``ScriptedEngine`` implements the ``Engine`` protocol with a Python function instead of a model:
``policy(request) -> reply text``. The reply is tokenized with the policy's tokenizer, truncated
to ``max_tokens`` (finish "length") or terminated with EOS (finish "stop", EOS included in the
ids like a real engine), and given fake logprobs (-0.5 each). Every request is recorded, so tests
can check that ``prompt_ids`` are exactly what the engine saw. (``scripts/bench_env_workers.py``
uses it too: it times env work with model-free agents.)

Lives under tests/ (not in the package): ``FaultyEnv`` registers the env ``testing_faulty`` when this
module is imported, so only processes that import it (tests, and env workers unpickling its envs)
know that env.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from megamarl.models.packaged import resolve_model_path
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.rollout.engines.base import Engine, Generation, SamplingParams


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The packaged real model's tokenizer (ChatML template, eos ``<|im_end|>``), loaded once."""
    from transformers import AutoTokenizer  # here: env worker processes import this module for FaultyEnv

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
        self,
        tokenizer: Any,
        policy: Callable[[ScriptedRequest], str],
        *,
        weight_version: int = 0,
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


def map_to_gamma(agent_id: str, episode_seed: int) -> str:
    """A ``rollout.policy_mapping`` naming an undefined policy (config validation tests)."""
    return "gamma"
