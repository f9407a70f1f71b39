"""reasoning-gym: its procedural task generators as solver/verifier tasks, scored by its own verifiers.

``datasets`` names reasoning-gym datasets (``chain_sum``, ``basic_arithmetic``, ... or
``{name, weight, config}``, ``config`` being the dataset's own config keys); each task draws a dataset
by weight and takes one item from reasoning-gym's generator, seeded from (seed, dataset), so tasks
are a function of (config, num_tasks, seed). No dataset downloads anything (the generators and the
few word lists they read ship in the wheel). The solver's answer is its last ``<answer>...</answer>``
block (reasoning-gym's convention), else its whole reply; the dataset's ``score_answer`` scores it in
[0, 1] (a scorer that raises on a malformed answer scores 0). The verifier says yes/no (math's
``math_verifier``) and an approval ends the episode; a rejected answer is shown to the solver.
Rewards: team and solver local = the latest answer's score; verifier local = 1 per turn if its
verdict matches ``score >= correct_at`` (unparseable: 0). The package is the ``reasoning-gym``
extra, imported only when a config names this env (a missing package is a load-time error).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, ClassVar

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.env import ENVS, Task
from megamarl.orchestration.envs.math import SolveVerifyConfig, SolveVerifyEnv

PACKAGE = "reasoning_gym"
EXTRA = "reasoning-gym"
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's
_NOT_TASKS = ("composite",)  # reasoning-gym's own mixer; datasets + weights here do its job


def _package() -> Any:
    """The ``reasoning_gym`` module, imported on first use (~4 CPU-s: it imports sympy, matplotlib)."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise ValueError(
            f"env 'reasoning_gym' needs the '{EXTRA}' package, which is not importable here: "
            f"pip install 'megamarl[{EXTRA}]' (or bash scripts/setup.sh --extras {EXTRA})"
        )
    return importlib.import_module(PACKAGE)


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # a reasoning-gym dataset (reasoning_gym.factory.DATASETS)
    weight: float = 1.0  # relative share of the tasks
    config: dict[str, Any] = field(default_factory=dict)  # the dataset's own config keys (not seed/size)

    def key(self) -> str:
        return json.dumps([self.name, self.config], sort_keys=True)


@dataclass
class ReasoningGymConfig(SolveVerifyConfig):
    # dataset names, or {name, weight, config} mappings
    datasets: tuple[Any, ...] = ("chain_sum", "basic_arithmetic")
    correct_at: float = 1.0  # a score at or above this is "correct" (the verifier's truth)

    def __post_init__(self) -> None:
        self.datasets = tuple(_spec(entry, i) for i, entry in enumerate(self.datasets))
        if not self.datasets:
            raise ValueError("env.kwargs.datasets is empty; name at least one reasoning-gym dataset")
        if not 0.0 < self.correct_at <= 1.0:
            raise ValueError(f"env.kwargs.correct_at must be in (0, 1], got {self.correct_at}")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"env.kwargs.datasets names a dataset twice: {names}")
        registered = _package().factory.DATASETS
        for i, spec in enumerate(self.datasets):
            if spec.name not in registered or spec.name in _NOT_TASKS:
                allowed = sorted(set(registered) - set(_NOT_TASKS))
                raise ValueError(
                    f"env.kwargs.datasets[{i}].name={spec.name!r} is no reasoning-gym dataset; "
                    f"allowed: {allowed}"
                )
            try:  # the dataset's own config rejects unknown keys and bad values now, not in the first rollout
                _dataset(spec.key())
            except (TypeError, ValueError, AssertionError) as exc:
                raise ValueError(f"env.kwargs.datasets[{i}].config for {spec.name!r}: {exc}") from None


def _spec(entry: Any, index: int) -> DatasetSpec:
    where = f"env.kwargs.datasets[{index}]"
    if isinstance(entry, DatasetSpec):
        return entry
    if isinstance(entry, str):
        return DatasetSpec(entry)
    if not isinstance(entry, Mapping) or "name" not in entry:
        raise ValueError(f"{where} must be a dataset name or a mapping with 'name', got {entry!r}")
    unknown = sorted(set(entry) - {"name", "weight", "config"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: ['config', 'name', 'weight']")
    config = dict(entry.get("config") or {})
    reserved = sorted({"seed", "size"} & set(config))
    if reserved:
        raise ValueError(f"{where}.config sets {reserved}: the env seeds and sizes each dataset itself")
    weight = float(entry.get("weight", 1.0))
    if not weight > 0:
        raise ValueError(f"{where}.weight must be > 0, got {weight}")
    return DatasetSpec(str(entry["name"]), weight, config)


@cache
def _dataset(key: str) -> Any:
    """One reasoning-gym dataset per (name, config) in this process, for its ``score_answer``."""
    name, config = json.loads(key)
    return _package().create_dataset(name, seed=0, size=1, **config)


@dataclass(frozen=True)
class ReasoningGymProblem:
    dataset: str  # DatasetSpec.key(): the dataset and its config, which score_answer may read
    question: str
    entry: dict[str, Any]  # reasoning-gym's item: question, answer, metadata


def extract_tagged_answer(text: str) -> tuple[str | None, bool]:
    """The last ``<answer>`` block, else the whole reply (stripped); invalid when empty."""
    blocks = _ANSWER.findall(text)
    answer = (blocks[-1] if blocks else text).strip()
    return (answer, True) if answer else (None, False)


def score_answer(problem: ReasoningGymProblem, answer: str | None) -> tuple[float, bool]:
    """reasoning-gym's score of ``answer`` in [0, 1], and whether its scorer ran without raising
    (a few raise on malformed answers, e.g. prime_factorization's int() of a word: scored 0)."""
    if answer is None:
        return 0.0, True
    try:
        return float(_dataset(problem.dataset).score_answer(answer, problem.entry)), True
    except Exception:  # noqa: BLE001 - a third-party scorer's failure on model text is a wrong answer
        return 0.0, False


@AGENTS.register("reasoning_gym_solver")
class ReasoningGymSolver(Agent):
    system_prompt = "You solve reasoning problems carefully."
    prompt_template = "{observation}\nGive your final answer between <answer> and </answer> tags."

    def parse(self, text: str):
        return extract_tagged_answer(text)


@ENVS.register("reasoning_gym")
class ReasoningGymEnv(SolveVerifyEnv[ReasoningGymConfig]):
    Config = ReasoningGymConfig
    default_agents: ClassVar[dict[str, str]] = {"solver": "reasoning_gym_solver", "verifier": "math_verifier"}

    def __init__(self, task: Task, config: ReasoningGymConfig) -> None:
        super().__init__(task, config)
        self.problem: ReasoningGymProblem = task.payload
        self.answer: str | None = None
        self.answer_score = 0.0
        self.num_score_errors = 0

    @classmethod
    def generate_tasks(cls, config: ReasoningGymConfig, *, num_tasks: int, seed: int) -> list[Task]:
        package = _package()
        specs: list[DatasetSpec] = list(config.datasets)
        picks = random.Random(seed).choices(range(len(specs)), [s.weight for s in specs], k=num_tasks)
        # One generator per dataset, seeded from (seed, its position); item i is a function of that
        # seed and i (reasoning-gym seeds each item with seed + index).
        generators = {
            k: package.create_dataset(s.name, seed=(seed * 1_000_003 + k) % 2**32, size=num_tasks, **s.config)
            for k, s in enumerate(specs)
            if k in picks
        }
        tasks = []
        for i, k in enumerate(picks):
            entry = generators[k][i]
            problem = ReasoningGymProblem(specs[k].key(), entry["question"], entry)
            tasks.append(Task(f"rg-{seed}-{i}-{specs[k].name}", problem))
        return tasks

    def _answer(self, action) -> float:
        self.answer = action.value if action.valid else None
        value, ran = score_answer(self.problem, self.answer)
        self.num_score_errors += not ran
        self.answer_score = value
        return value

    def correct(self) -> bool:
        return self.answer_score >= self.config.correct_at

    def _shown(self) -> str:
        return self.answer or "(none)"

    def _review(self) -> str:
        return (
            f"Problem: {self.problem.question}\nProposed answer: {self.answer or '(none)'}\n"
            "Is the answer correct? Reply yes or no."
        )

    def score(self, agent: str, action) -> float | None:
        if agent == "solver":
            return score_answer(self.problem, action.value if action.valid else None)[0]
        if agent == "verifier":
            return float(action.valid and action.value == self.correct())
        return None

    def team_reward(self) -> float:
        return self.answer_score

    def success(self) -> bool:
        return self.correct()

    def metrics(self) -> dict[str, float]:
        return {"score_errors": float(self.num_score_errors)}
