"""The scripts' command lines survive torchrun's own parser (``torch.distributed.run``).

torchrun parses its whole command line with argparse before it starts a rank, abbreviations
included: a script flag that is a prefix of one of torchrun's (``--run`` of ``--run-path``) is refused
as ambiguous, or taken as torchrun's, before the script sees it. Two checks against the real parser:
every flag of ``scripts/train.py`` and ``scripts/evaluate.py`` reaches the script untouched, and every
``torchrun`` line the scripts' docstrings and the README show parses, torchrun's side and the script's.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from script_loader import load_script  # tests/ helper
from torch.distributed.run import get_args_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train.py", "evaluate.py")


def _script_parser(script: str):
    return load_script(f"scripts/{script}", name=f"_cli_{Path(script).stem}").build_parser()


def _torchrun(argv: list[str]):
    """torchrun's parse of ``argv`` (what follows ``torchrun``); fails the test on its refusal."""
    try:
        return get_args_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's error: printed on stderr, exit 2
        pytest.fail(f"torchrun refuses {shlex.join(argv)} (exit {exc.code})")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_reaches_the_script(script):
    flags = [
        option
        for action in _script_parser(script)._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]
    assert flags
    for flag in flags:
        argv = ["--nproc_per_node", "2", f"scripts/{script}", flag, "x"]
        args = _torchrun(argv)
        assert (args.training_script, args.training_script_args) == (f"scripts/{script}", [flag, "x"]), flag


def _documented_lines() -> list[tuple[str, str]]:
    """(source, command) for every ``torchrun ... scripts/<train|evaluate>.py ...`` line shown in the
    scripts' docstrings and the README (a trailing ``# comment`` and ``[optional ...]`` dropped)."""
    pattern = re.compile(r"torchrun [^`#\n]*scripts/(?:train|evaluate)\.py[^`#\n]*")
    sources = [ROOT / "scripts" / s for s in SCRIPTS] + [ROOT / "README.md"]
    found = []
    for path in sources:
        for match in pattern.finditer(path.read_text(encoding="utf-8")):
            line = re.sub(r"\[[^\]]*\]", "", match.group(0)).strip().rstrip("\\").strip()
            found.append((path.name, line))
    return found


def test_the_documented_command_lines_parse():
    lines = _documented_lines()
    assert any("scripts/evaluate.py" in line for _, line in lines), lines
    for source, line in lines:
        argv = [word for word in shlex.split(line)[1:] if word != "..."]  # "torchrun ... scripts/": elided
        args = _torchrun(argv)
        script = Path(args.training_script).name
        assert script in SCRIPTS, (source, line)
        try:
            _script_parser(script).parse_args(args.training_script_args)
        except SystemExit as exc:
            pytest.fail(f"{source}: {script} refuses {line} (exit {exc.code})")


def test_run_is_refused_by_torchrun_so_the_flag_is_run_dir():
    """What the rename is for: torchrun itself refuses the old spelling."""
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--nproc_per_node", "2", "scripts/evaluate.py", "--run", "runs/x"])
