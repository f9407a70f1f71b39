"""Code judge: the candidate runs in the sandbox, the verdict is computed outside it.

Unlike "exit code 0 of candidate + tests in one program" (reward-hackable by ``os._exit(0)`` or by
reading the expected values), the sandbox only observes. Function-call cases: one sandboxed process
evaluates each case's expressions and ships their values as JSON records on a separate channel fd;
expected values and comparisons stay here (``same_value``). ``ExprCase``: one expression against a
literal. ``AssertCase``: an assert with no literal expectation, its comparison's operands shipped
(literal operands never enter the sandbox), pinned by ``pin_to`` to a reference run's values so that
nothing the candidate can forge passes it. stdin/stdout cases (``StdioCase``): one process per case,
its stdout compared here. A problem has one time budget (``budget_s``), and stops at the first case
that times out. Each case scores on its own (``Verdict.fraction``: the local reward). The judge is
total: reading or comparing that raises scores the case 0 (``Verdict.num_judge_errors``); a case
reported twice scores the run 0. Threat model: docs/design-notes.md, "megamarl/orchestration/judge.py".
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megamarl.orchestration.sandbox import SandboxConfig, run_python

# Runs inside the sandbox as main.py. Everything it calls after the candidate has run is bound first,
# and the tests' expressions see a copy of the builtins taken before the candidate ran, not the
# candidate's names: a candidate that patches builtins/json/os, or shadows a builtin, can only corrupt
# its own values, which are compared here (and, pinned, against values it cannot know).
_HARNESS = r"""
def _harness(fd, write, dumps, loads, evaluate, execute, compile_, exc_base, stdin, builtins):
    pristine = dict(vars(builtins))
    enumerate_, type_, str_ = enumerate, type, str
    request = loads(stdin.read())
    import io, sys
    sys.stdin = io.StringIO("")

    def emit(record):
        write(fd, (dumps(record) + "\n").encode())

    def why(exc):
        return (type_(exc).__name__ + ": " + str_(exc))[:300]

    namespace = {"__name__": "candidate", "__builtins__": builtins}
    try:
        execute(compile_(request["code"], "candidate.py", "exec"), namespace)
        tests = {k: v for k, v in namespace.items() if k not in pristine}
        tests.update(__name__="tests", __builtins__=pristine)
        for statement in request["setup"]:
            execute(compile_(statement, "tests.py", "exec"), tests)
    except exc_base as exc:
        emit({"load_error": why(exc)})
        return
    for i, (key, operands) in enumerate_(request["cases"]):
        texts = []
        try:
            for expr in operands:  # None: a literal operand, kept by the judge
                value = None if expr is None else evaluate(compile_(expr, "case", "eval"), tests)
                texts.append(None if expr is None else dumps(value, allow_nan=False))  # only plain data
        except exc_base as exc:
            emit({"i": i, "error": why(exc)})
            continue
        emit({"i": i, key: texts[0] if key == "value" else texts})

import builtins as _builtins, json as _json, os as _os, sys as _sys
_harness(__channel__, _os.write, _json.dumps, _json.loads, eval, exec, compile, BaseException, _sys.stdin,
         _builtins)
"""


@dataclass(frozen=True)
class ExprCase:
    """Evaluate ``expr`` in the sandbox; pass iff its value equals ``expected`` (a JSON value that
    stays here)."""

    expr: str
    expected: object


@dataclass(frozen=True)
class AssertCase:
    """``assert <test>`` with no literal expectation: ``operands`` of the comparison ``ops`` (AST
    names, ``Eq``, ``Lt``, ``In``...; none: ``operands[0]`` must be truthy). Literal operands are
    evaluated here, the others in the sandbox; the comparison is made here. ``pinned``: a reference
    run's values of the operands (``pin_to``); then every operand must also equal its pinned value
    (``()``: the reference gave none, the case fails)."""

    source: str
    operands: tuple[str, ...]
    ops: tuple[str, ...] = ()
    pinned: tuple | None = None


@dataclass(frozen=True)
class StdioCase:
    """Run the candidate as a program with ``stdin``; pass iff its stdout matches ``stdout``."""

    stdin: str
    stdout: str


@dataclass
class Verdict:
    passed: list[bool]
    messages: list[str] = field(default_factory=list)  # one per failed case, for feedback
    num_judge_errors: int = 0  # cases scored 0 because reading/comparing their output raised
    values: list[tuple | None] = field(default_factory=list)  # per function-call case: its operands' values

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and all(self.passed)

    @property
    def first_failure(self) -> str:
        return self.messages[0] if self.messages else ""


def same_value(got, want) -> bool:
    """Equality of two JSON values with strict types: a bool is not a number, a float does not answer
    an int (ints compare exactly), an int or a float answers a float within rel 1e-6 / abs 1e-9;
    strings and None exactly; lists and dicts recurse with the same rules. May raise
    (``OverflowError`` for a huge int against a float, ``RecursionError``): the judge catches that
    and scores the case 0."""
    if type(want) is float:
        return type(got) in (int, float) and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if type(want) is list:
        return type(got) is list and len(got) == len(want) and all(map(same_value, got, want))
    if type(want) is dict:
        return (
            type(got) is dict and got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
        )
    return type(got) is type(want) and got == want  # int, str, bool, None


def _contains(item, container) -> bool:
    if type(container) is list:
        return any(same_value(item, x) for x in container)
    if type(container) is dict:  # the candidate's keys went through JSON: compare item as a JSON key
        return type(item) in (str, int, float, bool) and next(iter(_json_value({item: 0}))) in container
    return type(container) is str and type(item) is str and item in container


def _identical(a, b) -> bool:  # ``is`` on JSON values: only the singletons have an identity to compare
    return a is None and b is None or type(a) is bool and type(b) is bool and a == b


# Python's comparison operators on JSON values; TypeError (``"a" < 1``) fails the case, as the
# assert would.
_COMPARE: dict[str, Callable[[object, object], bool]] = {
    "Eq": same_value,
    "NotEq": lambda a, b: not same_value(a, b),
    "Lt": lambda a, b: a < b,  # type: ignore[operator]
    "LtE": lambda a, b: a <= b,  # type: ignore[operator]
    "Gt": lambda a, b: a > b,  # type: ignore[operator]
    "GtE": lambda a, b: a >= b,  # type: ignore[operator]
    "In": _contains,
    "NotIn": lambda a, b: not _contains(a, b),
    "Is": _identical,
    "IsNot": lambda a, b: not _identical(a, b),
}


def same_output(got: str, want: str) -> bool:
    """stdout comparison as in APPS/CodeContests checkers: trailing spaces and blank lines ignored."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(got) == norm(want)


def _json_value(value):
    """``value`` as the judge will see the candidate's: tuples become lists, keys strings."""
    return json.loads(json.dumps(value, allow_nan=False))


_NOT_LITERAL = object()


def _literal(expr: str):
    """The JSON value of a literal expression, else ``_NOT_LITERAL`` (evaluated in the sandbox)."""
    try:
        return _json_value(ast.literal_eval(expr))
    except Exception:  # noqa: BLE001 - not a literal, or not JSON data (a set): the sandbox evaluates it
        return _NOT_LITERAL


def parse_assert_tests(source: str) -> tuple[list[str], list[ExprCase | AssertCase]]:
    """Split assert-style test code into (setup statements, cases). ``assert A == <literal>``
    becomes an ``ExprCase`` (the literal stays here); any other ``assert X`` an ``AssertCase`` of
    X's comparison operands (X itself when it is no comparison). Raises SyntaxError/ValueError for
    code that is not a test list."""
    setup: list[str] = []
    cases: list[ExprCase | AssertCase] = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assert):
            setup.append(ast.unparse(node))
            continue
        test = node.test
        if not isinstance(test, ast.Compare):
            cases.append(AssertCase(ast.unparse(test), (ast.unparse(test),)))
            continue
        operands = tuple(ast.unparse(o) for o in (test.left, *test.comparators))
        ops = tuple(type(op).__name__ for op in test.ops)
        if ops == ("Eq",):
            for probe, literal in (operands, operands[::-1]):
                expected = _literal(literal)
                if expected is not _NOT_LITERAL:
                    cases.append(ExprCase(probe, expected))
                    break
            else:
                cases.append(AssertCase(ast.unparse(test), operands, ops))
        else:
            cases.append(AssertCase(ast.unparse(test), operands, ops))
    if not cases:
        raise ValueError("no assert statements")
    return setup, cases


def call_case(fn_name: str, args: list, expected) -> ExprCase:
    """A dataset's function-call test: ``fn_name(*args) == expected`` (APPS ``fn_name`` style)."""
    # repr of JSON-decoded data (lists, dicts, str, numbers, bools, None) is a Python literal
    return ExprCase(f"{fn_name}(*{list(args)!r})", _json_value(expected))


def pin_to(cases: Sequence, reference: Verdict) -> list:
    """``cases`` with every ``AssertCase`` pinned to the values ``reference`` (a ``judge_calls``
    verdict of the same cases on the reference solution) gave its operands."""
    return [
        dataclasses.replace(case, pinned=reference.values[i] or ()) if isinstance(case, AssertCase) else case
        for i, case in enumerate(cases)
    ]


def _sandbox_side(case: ExprCase | AssertCase) -> tuple[str, list[str | None]]:
    """What the sandbox evaluates for ``case``: its record key and expressions (None: literal)."""
    if isinstance(case, ExprCase):
        return "value", [case.expr]
    return "values", [None if _literal(o) is not _NOT_LITERAL else o for o in case.operands]


def _score(case: ExprCase | AssertCase, shipped) -> tuple[bool, str, tuple]:
    """(passed, message, operand values) of ``case`` from what the sandbox shipped; may raise."""
    if isinstance(case, ExprCase):
        got = json.loads(shipped)
        return (
            same_value(got, case.expected),
            f"{case.expr} returned {shipped[:200]}, expected " + (json.dumps(case.expected)[:200]),
            (got,),
        )
    if not (isinstance(shipped, list) and len(shipped) == len(case.operands)):
        return False, f"assert {case.source}: malformed values", ()
    values = tuple(
        json.loads(text) if (literal := _literal(o)) is _NOT_LITERAL else literal
        for o, text in zip(case.operands, shipped, strict=True)
    )
    holds = bool(values[0]) if not case.ops else _holds(values, case.ops)
    shown = json.dumps(list(values))[:200]
    if holds and case.pinned is not None and not same_value(list(values), list(case.pinned)):
        return (
            False,
            f"assert {case.source}: values {shown}, expected {json.dumps(list(case.pinned))[:200]}",
            values,
        )
    return holds, f"assert {case.source} failed: values {shown}", values


def _holds(values: tuple, ops: tuple[str, ...]) -> bool:
    try:
        return all(_COMPARE[op](a, b) for op, a, b in zip(ops, values, values[1:], strict=False))
    except TypeError:  # "a" < 1: the assert would raise, the case fails
        return False


def judge_calls(
    code: str,
    cases: Sequence[ExprCase | AssertCase],
    config: SandboxConfig,
    *,
    setup: Sequence[str] = (),
    budget_s: float | None = None,
    isolated: bool = True,
) -> Verdict:
    """Score ``cases`` against ``code`` (function-call style) in one sandboxed process, which runs
    for at most ``budget_s`` (default and cap: ``config.timeout_s``); see the module docstring.
    ``isolated=False``: the old audit-hook sandbox (``env.kwargs.unsafe_inprocess``)."""
    sides = [_sandbox_side(c) for c in cases]
    request = {"code": code, "setup": list(setup), "cases": sides}
    if budget_s is not None and budget_s < config.timeout_s:
        config = dataclasses.replace(config, timeout_s=budget_s)
    result = run_python(_HARNESS, config, stdin=json.dumps(request).encode(), channel=True, isolated=isolated)
    shipped: dict[int, object] = {}
    errors: dict[int, str] = {}
    load_error = ""
    for line in result.channel.splitlines():
        try:
            record = json.loads(line)
            index = record.get("i")
        except Exception:  # noqa: BLE001, S112 - garbage (even a RecursionError) only loses its own case
            continue
        if "load_error" in record:
            load_error = str(record["load_error"])
            continue
        if not isinstance(index, int) or not 0 <= index < len(cases):
            continue
        if index in shipped or index in errors:
            return Verdict([False] * len(cases), [f"case {index} reported twice: forged results"])
        key = sides[index][0]
        if key in record and (key == "values" or isinstance(record[key], str)):
            shipped[index] = record[key]
        else:
            errors[index] = str(record.get("error", "error"))
    passed, messages, num_errors, values = [], [], 0, []
    status = result.status if result.status != "ok" else "exited before reporting"
    for i, case in enumerate(cases):
        ok, why, got = False, load_error or errors.get(i) or _last_line(result.stderr) or status, None
        if i in shipped:
            try:
                ok, why, got = _score(case, shipped[i])
            except Exception as exc:  # noqa: BLE001 - the judge is total: this case scores 0
                ok, why, num_errors = (
                    False,
                    f"case {i}: unreadable value ({type(exc).__name__})",
                    num_errors + 1,
                )
        passed.append(ok)
        values.append(got or None)
        if not ok:
            messages.append(why)
    return Verdict(passed, messages, num_errors, values)


def judge_stdio(
    code: str,
    cases: Sequence[StdioCase],
    config: SandboxConfig,
    *,
    budget_s: float | None = None,
    isolated: bool = True,
) -> Verdict:
    """Score stdin/stdout ``cases``: one fresh sandboxed process per case, its whole stdout compared
    with the whole expected output. All cases share ``budget_s`` (default ``config.timeout_s``),
    each case gets at most ``config.timeout_s`` of it, and the first case that times out ends the
    problem: the cases not run score 0."""
    deadline = time.monotonic() + (config.timeout_s if budget_s is None else budget_s)
    passed, messages, num_errors = [], [], 0
    stopped = ""
    for case in cases:
        left = deadline - time.monotonic()
        if stopped or left <= 0:
            stopped = stopped or "the problem's time budget is spent"
            passed.append(False)
            messages.append(f"input {case.stdin[:100]!r}: not run: {stopped}")
            continue
        run_config = dataclasses.replace(config, timeout_s=left) if left < config.timeout_s else config
        result = run_python(code, run_config, stdin=case.stdin.encode(), isolated=isolated)
        why = _last_line(result.stderr) if result.status != "ok" else "wrong output"
        try:
            ok = result.status == "ok" and same_output(result.stdout, case.stdout)
        except Exception as exc:  # noqa: BLE001 - the judge is total: this case scores 0
            ok, why, num_errors = False, f"unreadable output ({type(exc).__name__})", num_errors + 1
        if result.status == "timeout":
            stopped = "an earlier case timed out"
        passed.append(ok)
        if not ok:
            messages.append(f"input {case.stdin[:100]!r}: {why or result.status}")
    return Verdict(passed, messages, num_errors)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""
