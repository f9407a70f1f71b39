"""Code: a coder writes a Python function, a unit-tester writes assert-based tests for it.

Tasks are small function specs with parameters drawn from a seed (e.g. "return x * 7"), each
with a reference solution and hidden tests. All candidate code runs in ``sandbox.run_python``
(subprocess, rlimits, audit hook, no network), and the env declares ``remote_step`` so the
driver runs its steps in an env worker.

Transitions (use with the ``solve_verify`` orchestra, solver=coder, verifier=tester):
* coder step: keep the code; run it with the hidden tests -> ``hidden_pass``.
* tester step: run the tester's tests against the coder's code (``tests_pass``) and against the
  reference solution (``tests_valid``). If ``tests_pass`` the episode is done (approved);
  otherwise the failure output is shown to the coder next turn.

Rewards: team = 1 if the latest code passes the hidden tests. Tester local reward = 1 if its
tests are valid (pass on the reference) and agree with the hidden tests about the coder's code
(pass iff hidden tests pass), else 0. Coder local reward = ``hidden_pass``; it is also the
tree-sampling check fn for the coder.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from megamarl.orchestration.agents import AGENTS, Agent, code_block
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.orchestration.sandbox import SandboxConfig, run_python


@dataclass(frozen=True)
class CodeProblem:
    spec: str
    reference: str
    hidden_tests: str


def _scale(rng: random.Random) -> CodeProblem:
    k = rng.randint(2, 9)
    return CodeProblem(
        f"Write a Python function `scale(x)` that returns x multiplied by {k}.",
        f"def scale(x):\n    return x * {k}\n",
        f"assert scale(0) == 0\nassert scale(3) == {3 * k}\nassert scale(-2) == {-2 * k}\n",
    )


def _count_above(rng: random.Random) -> CodeProblem:
    t = rng.randint(1, 9)
    return CodeProblem(
        "Write a Python function `count_above(xs)` that returns how many numbers in the list xs are "
        f"greater than {t}.",
        f"def count_above(xs):\n    return sum(1 for x in xs if x > {t})\n",
        f"assert count_above([]) == 0\nassert count_above([{t}, {t + 1}, {t + 5}]) == 2\n"
        f"assert count_above([{t - 1}]) == 0\n",
    )


def _repeat_word(rng: random.Random) -> CodeProblem:
    n = rng.randint(2, 5)
    return CodeProblem(
        f"Write a Python function `repeat(s)` that returns the string s repeated {n} times.",
        f"def repeat(s):\n    return s * {n}\n",
        f"assert repeat('ab') == {'ab' * n!r}\nassert repeat('') == ''\n",
    )


def _clip(rng: random.Random) -> CodeProblem:
    lo = rng.randint(0, 5)
    hi = lo + rng.randint(2, 10)
    return CodeProblem(
        f"Write a Python function `clip(x)` that returns x limited to the range [{lo}, {hi}].",
        f"def clip(x):\n    return max({lo}, min({hi}, x))\n",
        f"assert clip({lo - 3}) == {lo}\nassert clip({hi + 4}) == {hi}\nassert clip({lo + 1}) == {lo + 1}\n",
    )


PROBLEM_KINDS = {"scale": _scale, "count_above": _count_above, "repeat": _repeat_word, "clip": _clip}


@dataclass
class CodeConfig(EnvConfig):
    kinds: tuple[str, ...] = tuple(PROBLEM_KINDS)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        bad = [k for k in self.kinds if k not in PROBLEM_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"env.kinds has {bad or 'nothing'}; allowed: {sorted(PROBLEM_KINDS)}")


@AGENTS.register("coder")
class Coder(Agent):
    system_prompt = "You write correct, minimal Python code."
    prompt_template = "{observation}\nReply with the code in a ```python block."

    def parse(self, text: str):
        return code_block(text)


@AGENTS.register("unit_tester")
class UnitTester(Agent):
    system_prompt = "You write Python unit tests as plain assert statements."
    prompt_template = "{observation}\nReply with assert statements in a ```python block."

    def parse(self, text: str):
        return code_block(text)


@ENVS.register("code")
class CodeEnv(Env):
    Config = CodeConfig
    agents = ("coder", "tester")
    default_agents = {"coder": "coder", "tester": "unit_tester"}
    remote_step = True

    def __init__(self, task: Task, config: CodeConfig) -> None:
        super().__init__(task, config)
        self.problem: CodeProblem = task.payload
        self.code: str | None = None
        self.hidden_pass = False
        self.feedback = ""

    @classmethod
    def generate_tasks(cls, config: CodeConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [
            Task(f"code-{seed}-{i}", PROBLEM_KINDS[config.kinds[i % len(config.kinds)]](rng))
            for i in range(num_tasks)
        ]

    def _run(self, program: str) -> tuple[bool, str]:
        result = run_python(program, self.config.sandbox)
        return result.ok, (result.stderr.strip().splitlines() or [result.status])[-1]

    def _hidden(self, code: str) -> bool:
        return self._run(f"{code}\n\n{self.problem.hidden_tests}")[0]

    def observe(self, agent: str) -> str:
        if agent == "coder":
            failed = f"\nYour previous code failed a test: {self.feedback}" if self.feedback else ""
            return self.problem.spec + failed
        code = self.code or ""
        return f"{self.problem.spec}\nThe candidate code:\n```python\n{code}```\nWrite tests for it."

    def step(self, agent: str, action) -> StepResult:
        if agent == "coder":
            self.code = action.value if action.valid else ""
            self.hidden_pass = bool(action.valid) and self._hidden(self.code)
            return StepResult(local_reward=float(self.hidden_pass))
        if not action.valid:
            return StepResult(local_reward=0.0, feedback="invalid tests")
        tests_pass, message = self._run(f"{self.code or ''}\n\n{action.value}")
        tests_valid, _ = self._run(f"{self.problem.reference}\n\n{action.value}")
        self.feedback = "" if tests_pass else message
        self.done = tests_pass
        return StepResult(local_reward=float(tests_valid and tests_pass == self.hidden_pass))

    def score(self, agent: str, action) -> float | None:
        if agent == "coder":
            return float(bool(action.valid) and self._hidden(action.value))
        return None

    def team_reward(self) -> float:
        return float(self.hidden_pass)
