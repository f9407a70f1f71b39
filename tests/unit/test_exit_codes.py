"""The errors that stop a run and their exit codes live in one ground-floor module (``megamarl.errors``),
and docs/reliability.md's table of ``scripts/train.py``'s exit codes says the same: each code once, each
run-stopping error with its code. No other module defines one or exits with a number of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megamarl import errors

ROOT = Path(__file__).resolve().parents[2]


def _stop_kinds() -> dict[str, type[errors.RunStoppedError]]:
    return {
        name: value
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, errors.RunStoppedError)
        and value is not errors.RunStoppedError
    }


def _documented() -> dict[int, str]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text[text.index("## Exit codes of `scripts/train.py`") :]
    table = table[: table.index("\n\n", table.index("| code |"))]
    return {
        int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", table, flags=re.MULTILINE)
    }


def test_each_code_once_and_documented():
    codes = {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert len(set(codes.values())) == len(codes), codes
    assert set(codes.values()) - {errors.EXIT_OK} <= set(_documented()), (codes, sorted(_documented()))
    assert sorted(_documented()) == sorted(set(codes.values())), "a documented code without its constant"


def test_each_run_stopping_error_has_its_documented_code():
    documented = _documented()
    kinds = _stop_kinds()
    assert {
        "NumericalFaultError",
        "CheckpointWriteError",
        "RolloutFailureError",
        "RefillExhaustedError",
    } <= set(kinds)
    for name, kind in kinds.items():
        assert issubclass(kind, RuntimeError)  # what they were: code catching RuntimeError is unchanged
        row = documented[kind.exit_code]
        named = name if name != "RefillExhaustedError" else "RolloutFailureError"  # documented with its base
        assert f"`{named}`" in row, (name, kind.exit_code, row)


def _files() -> list[Path]:
    return [*ROOT.glob("megamarl/**/*.py"), *ROOT.glob("scripts/**/*.py")]


def test_no_other_module_defines_a_run_stopping_error():
    kinds = {*_stop_kinds(), "RunStoppedError"}
    found = []
    for path in _files():
        if path == ROOT / "megamarl" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (
                node.name in kinds or any(ast.unparse(b).split(".")[-1] in kinds for b in node.bases)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}")
    assert not found, found


def test_no_module_exits_with_a_number_of_its_own():
    """``sys.exit(3)``, ``SystemExit(2)``, ``os._exit(6)``: a non-zero literal code outside megamarl.errors
    (0 is a child process's normal end)."""
    exits = {"sys.exit", "SystemExit", "os._exit", "exit"}
    found = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in exits
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, int)
                and node.args[0].value != 0
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_the_launch_returns_the_codes_by_name():
    """scripts/train.py and scripts/evaluate.py return named codes (``exc.exit_code``, ``EXIT_*``), not
    numbers."""
    for script in ("train.py", "evaluate.py"):
        tree = ast.parse((ROOT / "scripts" / script).read_text())
        numbers = [
            f"{script}:{node.lineno} {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Return)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int)
        ]
        assert not numbers, numbers
