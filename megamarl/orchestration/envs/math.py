"""Math: a solver answers an arithmetic question, a verifier approves or rejects the answer.

Tasks are seeded (``kinds``: ``add1``, ``mul1``, ``add2``, ``mul12``, ``word``) or a JSONL file of
``{"question", "answer"}`` (``dataset_path``); answers are exact numbers. The solver's answer is the
LAST number of its reply; the verifier's verdict is its last yes/no-style word, and an approval ends
the episode (``with_verifier=False``: the solver alone). A rejected answer is shown to the solver.
Rewards: team = 1 if the latest answer is right; verifier local = 1 per turn if its verdict matches the
answer's correctness (unparseable: 0); solver local = its answer's correctness (also the tree-sampling
check fn). Own success: the solver's is the team's, the verifier's "every verdict right".
Details: docs/design-notes.md, "megamarl/orchestration/envs/math.py".
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from megamarl.orchestration.agents import AGENTS, Agent, last_number, verdict
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task, draw_from_dataset, read_jsonl


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: float
    kind: str


def _binary(lo: int, hi: int, symbol: str, op: Callable[[int, int], int]):
    def make(rng: random.Random) -> tuple[str, float]:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"What is {a} {symbol} {b}?", float(op(a, b))

    return make


_WORD_TEMPLATES = (
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} stickers and gave away {b}. How many stickers are left?", lambda a, b: a - b),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b),
    ("{name} reads {a} pages a day for {b} days. How many pages does {name} read?", lambda a, b: a * b),
    ("There are {a} birds on a tree and {b} more arrive. How many birds are there now?", lambda a, b: a + b),
)
_NAMES = ("Tom", "Sara", "Ali", "Mia", "Ken", "Ana")


def _word(rng: random.Random) -> tuple[str, float]:
    template, op = rng.choice(_WORD_TEMPLATES)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    a, b = max(a, b), min(a, b)  # keeps subtraction non-negative
    return template.format(name=rng.choice(_NAMES), a=a, b=b), float(op(a, b))


PROBLEM_KINDS: dict[str, Callable[[random.Random], tuple[str, float]]] = {
    "add1": _binary(0, 9, "+", lambda a, b: a + b),
    "mul1": _binary(0, 9, "x", lambda a, b: a * b),
    "add2": _binary(10, 99, "+", lambda a, b: a + b),
    "mul12": _binary(1, 12, "x", lambda a, b: a * b),
    "word": _word,
}


@dataclass
class SolveVerifyConfig(EnvConfig):
    with_verifier: bool = True  # false: the solver's answer ends the episode


@dataclass
class MathConfig(SolveVerifyConfig):
    kinds: tuple[str, ...] = ("add1", "mul1", "add2", "mul12", "word")
    dataset_path: str | None = None  # JSONL {"question", "answer"}; replaces generation

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        bad = [k for k in self.kinds if k not in PROBLEM_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"env.kinds has {bad or 'nothing'}; allowed: {sorted(PROBLEM_KINDS)}")
        if self.dataset_path is not None:
            load_jsonl(
                self.dataset_path
            )  # a bad file fails at load time, naming env.dataset_path, file and line


def load_jsonl(path: str | Path) -> list[MathProblem]:
    """Read ``{"question": str, "answer": number or numeric string}`` lines; errors name
    ``env.dataset_path``, the file and the line (``read_jsonl``)."""
    problems = []
    for where, record in read_jsonl(path, key="env.dataset_path"):
        missing = [k for k in ("question", "answer") if k not in record]
        if missing:
            raise ValueError(
                f"{where}: each line needs 'question' and 'answer'; missing {missing}, "
                f"has {sorted(record)[:10]}"
            )
        if not isinstance(record["question"], str) or not record["question"].strip():
            raise ValueError(f"{where}: 'question' must be non-empty text, got {_short(record['question'])}")
        answer, ok = last_number(str(record["answer"]))
        if not ok or isinstance(record["answer"], (bool, dict, list)):
            raise ValueError(f"{where}: answer {_short(record['answer'])} is not a number")
        assert answer is not None  # ok: a number was found
        problems.append(MathProblem(record["question"], answer, "dataset"))
    return problems


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def answer_correct(value: float | None, truth: float) -> bool:
    return value is not None and abs(value - truth) < 1e-6


@AGENTS.register("math_solver")
class MathSolver(Agent):
    system_prompt = "You are a careful math solver."
    prompt_template = "{observation}\nEnd your reply with the final answer as a number."

    def parse(self, text: str):
        return last_number(text)


@AGENTS.register("math_verifier")
class MathVerifier(Agent):
    system_prompt = "You check solutions to math problems."

    def parse(self, text: str):
        return verdict(text)


SolveVerifyConfigT = TypeVar("SolveVerifyConfigT", bound=SolveVerifyConfig)


class SolveVerifyEnv(Env[SolveVerifyConfigT]):
    """The solve/verify protocol of answer-checking envs (math, reasoning_gym): the solver answers;
    the verifier approves (the episode ends) or rejects (the solver sees the rejected answer and
    tries again), rewarded for a verdict that matches the truth. A subclass says what an answer is
    and scores (``_answer``), whether it is correct (``correct``), how a rejected one is shown
    (``_shown``) and what the verifier reviews (``_review``); ``problem.question`` is the task."""

    agents = ("solver", "verifier")

    def __init__(self, task: Task, config: SolveVerifyConfigT) -> None:
        super().__init__(task, config)
        self.problem: Any = task.payload
        self.rejected: list[str] = []  # answers the verifier rejected, shown to the solver
        self.verdicts_right: list[bool] = []  # per verifier turn: did its verdict match the truth

    @classmethod
    def acting_roles(cls, config: SolveVerifyConfigT) -> tuple[str, ...]:
        return cls.agents if config.with_verifier else ("solver",)

    @abc.abstractmethod
    def _answer(self, action) -> float:
        """Record the solver's answer; its local reward."""

    @abc.abstractmethod
    def correct(self) -> bool:
        """Whether the current answer is right (the verifier's truth)."""

    @abc.abstractmethod
    def _shown(self) -> str:
        """The current answer as a rejection shows it to the solver."""

    @abc.abstractmethod
    def _review(self) -> str:
        """The verifier's observation."""

    def active_agents(self) -> list[str]:
        if self.done:
            return []
        return ["solver", "verifier"] if self.config.with_verifier else ["solver"]

    def observe(self, agent: str) -> str:
        if agent == "solver":
            if not self.rejected:
                return self.problem.question
            last = self.rejected[-1]
            return f"{self.problem.question}\nA reviewer rejected your previous answer: {last}. Try again."
        return self._review()

    def step(self, agent: str, action) -> StepResult:
        if agent == "solver":
            local = self._answer(action)
            if not self.config.with_verifier:
                self.done = True
            return StepResult(local_reward=local)
        matched = action.valid and action.value == self.correct()
        self.verdicts_right.append(bool(matched))
        if action.valid and action.value:
            self.done = True
        elif action.valid:
            self.rejected.append(self._shown())
        return StepResult(local_reward=float(matched), feedback="approved" if self.done else "rejected")

    def agent_success(self, agent: str) -> bool | None:
        """The verifier succeeds when every verdict it gave was right (its own job, whatever the
        solver answered); the solver's success is the team's."""
        if agent == "verifier":
            return bool(self.verdicts_right) and all(self.verdicts_right)
        return None


@ENVS.register("math")
class MathEnv(SolveVerifyEnv[MathConfig]):
    Config = MathConfig
    default_agents: ClassVar[dict[str, str]] = {"solver": "math_solver", "verifier": "math_verifier"}

    def __init__(self, task: Task, config: MathConfig) -> None:
        super().__init__(task, config)
        self.problem: MathProblem = task.payload
        self.answer: float | None = None
        self.answer_text = ""
        self.num_solver_turns = 0

    @classmethod
    def generate_tasks(cls, config: MathConfig, *, num_tasks: int, seed: int) -> list[Task]:
        if config.dataset_path is not None:
            problems = load_jsonl(config.dataset_path)
            picks = draw_from_dataset(len(problems), num_tasks, seed=seed, prefix="math-file")
            return [Task(task_id, problems[j]) for j, task_id in picks]
        rng = random.Random(seed)
        tasks = []
        for i in range(num_tasks):
            kind = config.kinds[i % len(config.kinds)]
            question, answer = PROBLEM_KINDS[kind](rng)
            tasks.append(Task(f"math-{seed}-{i}", MathProblem(question, answer, kind)))
        return tasks

    def _answer(self, action) -> float:
        self.answer = action.value if action.valid else None
        self.answer_text = action.text
        self.num_solver_turns += 1
        return float(self.correct())

    def correct(self) -> bool:
        return answer_correct(self.answer, self.problem.answer)

    def _shown(self) -> str:
        return _format_number(self.answer)

    def _review(self) -> str:
        return (
            f"Problem: {self.problem.question}\nProposed solution: {self.answer_text.strip()}\n"
            "Is the final answer correct? Reply yes or no."
        )

    def score(self, agent: str, action) -> float | None:
        if agent == "solver":
            return float(action.valid and answer_correct(action.value, self.problem.answer))
        if agent == "verifier":
            return float(action.valid and action.value == self.correct())
        return None

    def team_reward(self) -> float:
        return float(self.correct())


def _format_number(value: float | None) -> str:
    if value is None:
        return "no number"
    return str(int(value)) if float(value).is_integer() else str(value)
