"""Code judge: the candidate runs in the sandbox, the verdict is computed outside it.

Unlike "exit code 0 of candidate + tests in one program" (reward-hackable by ``os._exit(0)`` or by
reading the expected values), the sandbox only observes. Function-call cases (``ExprCase``): one
sandboxed process evaluates each expression and writes JSON records on a separate channel fd; the
expected values stay here and are compared after a JSON round trip. stdin/stdout cases
(``StdioCase``): one process per case, its full stdout compared here (trailing whitespace per line
ignored). Each case scores on its own: ``Verdict.fraction`` is the local reward, ``all_passed`` the
success. The judge is total: any exception reading or comparing scores that case 0 and counts in
``Verdict.num_judge_errors``, never dropping the episode; a case reported twice scores the run 0.
The threat model in full: docs/design-notes.md, "megamarl/orchestration/judge.py".
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megamarl.orchestration.sandbox import SandboxConfig, run_python

NO_EXPECTED = object()  # an ExprCase whose expression must evaluate to True (``assert expr``)

# Runs inside the sandbox as main.py. It binds everything it needs before the candidate runs, so
# a candidate that patches builtins/json/os can only corrupt its own records (scoring 0).
_HARNESS = r"""
def _harness(fd, write, dumps, loads, evaluate, compile_, exc_base, stdin):
    request = loads(stdin.read())
    import io, sys
    sys.stdin = io.StringIO("")

    def emit(record):
        write(fd, (dumps(record) + "\n").encode())

    namespace = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        exec(compile_(request["code"], "candidate.py", "exec"), namespace)
        for statement in request["setup"]:
            exec(compile_(statement, "tests.py", "exec"), namespace)
    except exc_base as exc:
        emit({"load_error": f"{type(exc).__name__}: {exc}"[:300]})
        return
    for i, expr in enumerate(request["exprs"]):
        try:
            value = evaluate(compile_(expr, f"case{i}", "eval"), namespace)
            text = dumps(value, allow_nan=False)  # custom objects raise: only plain data counts
        except exc_base as exc:
            emit({"i": i, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        emit({"i": i, "value": text})

import json as _json, os as _os, sys as _sys
_harness(__channel__, _os.write, _json.dumps, _json.loads, eval, compile, BaseException, _sys.stdin)
"""


@dataclass(frozen=True)
class ExprCase:
    """Evaluate ``expr`` in the candidate's namespace; pass iff it equals ``expected`` (a JSON
    value; ``NO_EXPECTED`` means "is True")."""

    expr: str
    expected: object = NO_EXPECTED


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
    """Equality of two JSON values with strict types (True is not 1), ints exactly, floats with a
    tolerance. May raise (``OverflowError`` for a huge int against a float, ``RecursionError``):
    the judge catches that and scores the case 0."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if type(want) is int and type(got) is int:
        return got == want  # exact: 10**17 + 1 is not 10**17
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def same_output(got: str, want: str) -> bool:
    """stdout comparison as in APPS/CodeContests checkers: trailing spaces and blank lines ignored."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(got) == norm(want)


def _json_value(value):
    """``value`` as the judge will see the candidate's: tuples become lists, keys strings."""
    return json.loads(json.dumps(value, allow_nan=False))


def parse_assert_tests(source: str) -> tuple[list[str], list[ExprCase]]:
    """Split assert-style test code into (setup statements, cases). ``assert A == <literal>``
    keeps the literal on the judge side; any other ``assert X`` becomes ``bool(X)`` expected True.
    Raises SyntaxError/ValueError for code that is not a test list."""
    setup, cases = [], []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assert):
            setup.append(ast.unparse(node))
            continue
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            for probe, literal in ((left, right), (right, left)):
                try:
                    expected = _json_value(ast.literal_eval(literal))
                except (ValueError, TypeError, SyntaxError):
                    continue
                cases.append(ExprCase(ast.unparse(probe), expected))
                break
            else:
                cases.append(ExprCase(f"bool({ast.unparse(test)})", True))
        else:
            cases.append(ExprCase(f"bool({ast.unparse(test)})", True))
    if not cases:
        raise ValueError("no assert statements")
    return setup, cases


def call_case(fn_name: str, args: list, expected) -> ExprCase:
    """A dataset's function-call test: ``fn_name(*args) == expected`` (APPS ``fn_name`` style)."""
    # repr of JSON-decoded data (lists, dicts, str, numbers, bools, None) is a Python literal
    return ExprCase(f"{fn_name}(*{list(args)!r})", _json_value(expected))


def judge_calls(
    code: str,
    cases: list[ExprCase],
    config: SandboxConfig,
    *,
    setup: Sequence[str] = (),
    isolated: bool = True,
) -> Verdict:
    """Score ``cases`` against ``code`` (function-call style); see the module docstring.
    ``isolated=False``: the old audit-hook sandbox (``env.kwargs.unsafe_inprocess``)."""
    request = {"code": code, "setup": list(setup), "exprs": [c.expr for c in cases]}
    result = run_python(_HARNESS, config, stdin=json.dumps(request).encode(), channel=True, isolated=isolated)
    values: dict[int, str] = {}
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
        if index in values or index in errors:
            return Verdict([False] * len(cases), [f"case {index} reported twice: forged results"])
        if "value" in record and isinstance(record["value"], str):
            values[index] = record["value"]
        else:
            errors[index] = str(record.get("error", "error"))
    passed, messages, num_errors = [], [], 0
    status = result.status if result.status != "ok" else "exited before reporting"
    for i, case in enumerate(cases):
        ok, why = False, load_error or errors.get(i) or _last_line(result.stderr) or status
        if i in values:
            want = True if case.expected is NO_EXPECTED else case.expected
            try:
                ok = same_value(json.loads(values[i]), want)
                why = f"{case.expr} returned {values[i][:200]}, expected {json.dumps(want)[:200]}"
            except Exception as exc:  # noqa: BLE001 - the judge is total: this case scores 0
                ok, why, num_errors = (
                    False,
                    f"{case.expr}: unreadable value ({type(exc).__name__})",
                    num_errors + 1,
                )
        passed.append(ok)
        if not ok:
            messages.append(why)
    return Verdict(passed, messages, num_errors)


def judge_stdio(
    code: str, cases: list[StdioCase], config: SandboxConfig, *, isolated: bool = True
) -> Verdict:
    """Score stdin/stdout ``cases``: one fresh sandboxed process per case, its whole stdout
    compared with the whole expected output."""
    passed, messages, num_errors = [], [], 0
    for case in cases:
        result = run_python(code, config, stdin=case.stdin.encode(), isolated=isolated)
        why = _last_line(result.stderr) if result.status != "ok" else "wrong output"
        try:
            ok = result.status == "ok" and same_output(result.stdout, case.stdout)
        except Exception as exc:  # noqa: BLE001 - the judge is total: this case scores 0
            ok, why, num_errors = False, f"unreadable output ({type(exc).__name__})", num_errors + 1
        passed.append(ok)
        if not ok:
            messages.append(f"input {case.stdin[:100]!r}: {why or result.status}")
    return Verdict(passed, messages, num_errors)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""
