"""Code: a coder writes a Python function, a unit-tester writes assert-based tests for it.

Tasks: seeded small function specs (reference solution, hidden tests) or a JSONL file (``env.dataset``,
``load_problems``: function-call or stdin/stdout tests). Code is scored by ``judge`` (candidate in the
sandbox, verdicts outside); the env declares ``remote_step``, so its steps run in an env worker. Use with
``solve_verify`` (solver=coder, verifier=tester): the coder's code is judged on the hidden tests; the
tester's asserts are run on the reference (``tests_valid``) and then on the coder's code, their
non-literal operands pinned to the reference's values (``tests_pass``: the episode is done), the
first failure shown to the coder otherwise. Hidden asserts with no literal side are pinned the same
way. Rewards: team = 1 if the latest code passes every hidden test; tester = 1 if its tests are valid
and agree with the hidden tests about the code; coder = fraction of hidden tests passed (also its
tree-sampling check fn). A judging has ``problem_budget_s``; a step judges at most twice, which must
fit ``rollout.env_timeout_s`` (``max_step_s``, checked at load).
Details: docs/design-notes.md, "megamarl/orchestration/envs/code.py".
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass, field
from typing import ClassVar

from megamarl.orchestration.agents import AGENTS, Agent, code_block
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task, read_jsonl
from megamarl.orchestration.judge import (
    AssertCase,
    ExprCase,
    StdioCase,
    Verdict,
    call_case,
    judge_calls,
    judge_stdio,
    parse_assert_tests,
    pin_to,
)
from megamarl.orchestration.sandbox import SandboxConfig, isolation_error


@dataclass(frozen=True)
class CodeProblem:
    """``hidden_tests``: assert statements (their expected literals stay in the judge) or, for
    dataset problems, ready ``cases``. ``stdio``: the cases are StdioCase (whole programs)."""

    spec: str
    reference: str | None
    hidden_tests: str = ""
    cases: tuple[ExprCase | StdioCase, ...] = ()
    stdio: bool = False

    def hidden_cases(self) -> tuple[list[str], list]:
        """(setup statements, cases) of the hidden tests."""
        return ([], list(self.cases)) if self.cases else parse_assert_tests(self.hidden_tests)


def load_problems(path: str) -> list[CodeProblem]:
    """A JSONL file, one problem a line, in either form:

    * ``{"spec": str, "fn_name": str, "tests": [{"input": [args...], "output": value}, ...],
      "reference": str?}``: function-call tests;
    * ``{"spec": str, "tests": [{"input": "stdin text", "output": "stdout text"}, ...]}``:
      stdin/stdout tests (no ``fn_name``);
    * APPS style: ``{"question": str, "input_output": {"inputs": [...], "outputs": [...],
      "fn_name": str?}, "solutions": [str, ...]?}`` (solutions may be a JSON-encoded list).
    """
    problems = []
    for where, row in read_jsonl(path, key="env.dataset"):  # the file's own faults: named with file and line
        try:
            problems.append(_problem_from_row(row))
        except KeyError as exc:
            raise ValueError(f"{where}: missing field {exc}; has {sorted(row)[:10]}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    return problems


def _problem_from_row(row: dict) -> CodeProblem:
    if "input_output" in row:  # APPS
        io_spec = row["input_output"]
        io_spec = json.loads(io_spec) if isinstance(io_spec, str) else io_spec
        tests = [
            {"input": i, "output": o} for i, o in zip(io_spec["inputs"], io_spec["outputs"], strict=True)
        ]
        solutions = row.get("solutions") or []
        solutions = json.loads(solutions) if isinstance(solutions, str) else solutions
        row = {
            "spec": row["question"],
            "fn_name": io_spec.get("fn_name"),
            "tests": tests,
            "reference": solutions[0] if solutions else None,
        }
    fn_name, tests = row.get("fn_name"), row["tests"]
    if not tests:
        raise ValueError("no tests")
    cases: tuple[ExprCase | StdioCase, ...]
    if fn_name:
        cases = tuple(call_case(fn_name, list(t["input"]), t["output"]) for t in tests)
    else:
        cases = tuple(StdioCase(_text(t["input"]), _text(t["output"])) for t in tests)
    return CodeProblem(str(row["spec"]), row.get("reference"), cases=cases, stdio=not fn_name)


def _text(value) -> str:
    if isinstance(value, list):  # APPS sometimes stores stdin/stdout as a list of lines
        return "\n".join(map(str, value))
    if not isinstance(value, str):
        raise TypeError(f"stdin/stdout tests need text, got {type(value).__name__}")
    return value


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
    dataset: str | None = None  # JSONL of problems (load_problems); replaces the generated kinds
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # True: run candidates in the old audit-hook sandbox (same uid as the judge, no namespaces but
    # the network one): candidates can read the judge's memory. Only where isolation is impossible.
    unsafe_inprocess: bool = False
    # seconds one judging (a candidate on all of a problem's cases) may take in all; a step judges at
    # most twice (reference, then candidate), so 2 x (this + JUDGE_START_S) must be below
    # rollout.env_timeout_s (checked at load)
    problem_budget_s: float = 12.0

    def __post_init__(self) -> None:
        if not (isinstance(self.problem_budget_s, (int, float)) and self.problem_budget_s > 0):
            raise ValueError(
                f"env.kwargs.problem_budget_s must be seconds > 0, got {self.problem_budget_s!r}"
            )
        self.kinds = tuple(self.kinds)
        bad = [k for k in self.kinds if k not in PROBLEM_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"env.kinds has {bad or 'nothing'}; allowed: {sorted(PROBLEM_KINDS)}")
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig(**self.sandbox)
        if not isinstance(self.unsafe_inprocess, bool):
            raise ValueError(  # noqa: TRY004 - config errors are ValueErrors (exit 2)
                f"env.kwargs.unsafe_inprocess must be true or false, got {self.unsafe_inprocess!r}"
            )
        reason = None if self.unsafe_inprocess else isolation_error()
        if reason is not None:
            raise ValueError(
                f"env 'code' cannot isolate candidate code here: {reason}. Set "
                "env.kwargs.unsafe_inprocess=true to run it in the old audit-hook sandbox "
                "(not a security boundary; see docs/reliability.md)"
            )
        if self.dataset is not None:
            load_problems(self.dataset)  # a bad file fails at load time, naming env.dataset


JUDGE_START_S = 1.0  # per judging, beyond its budget: starting the sandbox, killing it at the deadline
JUDGINGS_PER_STEP = 2  # a tester step runs the tests on the reference and on the code; a coder step
# with pinned hidden asserts runs the reference (once per episode) and the code


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
class CodeEnv(Env[CodeConfig]):
    Config = CodeConfig
    agents = ("coder", "tester")
    default_agents: ClassVar[dict[str, str]] = {"coder": "coder", "tester": "unit_tester"}
    remote_step = True

    def __init__(self, task: Task, config: CodeConfig) -> None:
        super().__init__(task, config)
        self.problem: CodeProblem = task.payload
        self.code: str | None = None
        self.hidden_fraction = 0.0
        self.hidden_pass = False
        self.feedback = ""
        self.judge_errors = 0  # cases scored 0 because their output could not be read/compared
        self._hidden_pins: list | None = None  # the hidden cases pinned to the reference's values

    @classmethod
    def max_step_s(cls, config: CodeConfig) -> float:
        return JUDGINGS_PER_STEP * (config.problem_budget_s + JUDGE_START_S)

    @classmethod
    def generate_tasks(cls, config: CodeConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        if config.dataset is not None:
            problems = load_problems(config.dataset)
            order = rng.sample(range(len(problems)), len(problems))
            return [Task(f"code-{seed}-{i}", problems[order[i % len(order)]]) for i in range(num_tasks)]
        return [
            Task(f"code-{seed}-{i}", PROBLEM_KINDS[config.kinds[i % len(config.kinds)]](rng))
            for i in range(num_tasks)
        ]

    def _judge(self, code: str, setup: list[str], cases: list) -> Verdict:
        isolated = not self.config.unsafe_inprocess
        budget_s = self.config.problem_budget_s
        if self.problem.stdio:
            verdict = judge_stdio(code, cases, self.config.sandbox, budget_s=budget_s, isolated=isolated)
        else:
            verdict = judge_calls(
                code, cases, self.config.sandbox, setup=setup, budget_s=budget_s, isolated=isolated
            )
        self.judge_errors += verdict.num_judge_errors
        return verdict

    def metrics(self) -> dict[str, float]:
        return {"judge_errors": float(self.judge_errors)}

    def _hidden(self, code: str) -> Verdict:
        setup, cases = self.problem.hidden_cases()
        if self._hidden_pins is None:
            needs_pins = any(isinstance(c, AssertCase) for c in cases)
            self._hidden_pins = self._on_reference(setup, cases)[1] if needs_pins else cases
        return self._judge(code, setup, self._hidden_pins)

    def _on_reference(self, setup: list[str], cases: list) -> tuple[Verdict | None, list]:
        """The reference's verdict on ``cases`` and ``cases`` with their asserts pinned to the
        reference's values; (None, ``cases``) without a reference, where an assert with no literal
        side trusts the candidate's values."""
        if self.problem.reference is None:
            return None, cases
        verdict = self._judge(self.problem.reference, setup, cases)
        return verdict, pin_to(cases, verdict)

    def _tester_cases(self, tests: str) -> tuple[list[str], list]:
        """The tester's asserts as judge cases; raises for anything that is not a test list."""
        if not self.problem.stdio:
            return parse_assert_tests(tests)
        cases = []  # ``assert run("<stdin>") == "<stdout>"`` per line
        for node in ast.parse(tests).body:
            test = getattr(node, "test", None)
            if not (
                isinstance(test, ast.Compare)
                and isinstance(test.left, ast.Call)
                and getattr(test.left.func, "id", "") == "run"
                and len(test.left.args) == 1
            ):
                raise ValueError("stdin/stdout tests are lines `assert run('<input>') == '<output>'`")
            stdin, stdout = ast.literal_eval(test.left.args[0]), ast.literal_eval(test.comparators[0])
            cases.append(StdioCase(str(stdin), str(stdout)))
        if not cases:
            raise ValueError("no assert statements")
        return [], cases

    def observe(self, agent: str) -> str:
        if agent == "coder":
            failed = f"\nYour previous code failed a test: {self.feedback}" if self.feedback else ""
            return self.problem.spec + failed
        code = self.code or ""
        form = " as lines `assert run('<stdin>') == '<expected stdout>'`" if self.problem.stdio else ""
        return f"{self.problem.spec}\nThe candidate code:\n```python\n{code}```\nWrite tests for it{form}."

    def step(self, agent: str, action) -> StepResult:
        if agent == "coder":
            self.code = action.value if action.valid else ""
            verdict = self._hidden(self.code) if action.valid else None
            self.hidden_fraction = verdict.fraction if verdict else 0.0
            self.hidden_pass = bool(verdict and verdict.all_passed)
            return StepResult(local_reward=self.hidden_fraction)
        if not action.valid:
            return StepResult(local_reward=0.0, feedback="invalid tests")
        try:
            setup, cases = self._tester_cases(action.value)
        except (SyntaxError, ValueError, TypeError) as exc:
            return StepResult(local_reward=0.0, feedback=f"invalid tests: {exc}")
        on_reference, cases = self._on_reference(setup, cases)
        tests_valid = on_reference is None or on_reference.all_passed
        on_code = self._judge(self.code or "", setup, cases)
        tests_pass = on_code.all_passed
        self.feedback = "" if tests_pass else on_code.first_failure
        self.done = tests_pass
        return StepResult(local_reward=float(tests_valid and tests_pass == self.hidden_pass))

    def score(self, agent: str, action) -> float | None:
        if agent == "coder":
            return self._hidden(action.value).fraction if action.valid else 0.0
        return None

    def team_reward(self) -> float:
        return float(self.hidden_pass)
