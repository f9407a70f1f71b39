"""The front door under torchrun (issue #28 item 4): a config error is checked by every rank before it
starts any work; rank 0 prints the one line, the other ranks wait ``QUIET_RANK_GRACE_S`` and are
stopped by torchrun when rank 0 exits, so the user reads one ``config error:`` line, not one per rank.
torchrun itself exits 1 with its ChildFailedError block (its agent turns any failed worker into
that; no option passes a worker's code through), whose root cause shows our exit code 2.
``train.py --check`` before torchrun gives the bare exit 2 (docs/reliability.md, "The front door")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
OVERRIDE = "trainer.total_step=3"  # a typo
LINE = "config error: config key 'trainer.total_step': unknown key; did you mean trainer.total_steps?"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_config_error_under_torchrun_is_one_line_and_torchruns_exit_1():
    proc = _run(
        [
            str(TORCHRUN),
            "--nproc_per_node",
            "2",
            "--standalone",
            "scripts/train.py",
            "--config",
            "configs/signalling_tiny.yaml",
            OVERRIDE,
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert ours == [LINE], proc.stderr[-3000:]  # rank 1 was stopped during its grace period, silent
    assert "exitcode  : 2" in proc.stderr and "ChildFailedError" in proc.stderr
    assert "Traceback" not in proc.stderr.split("failed (exitcode")[0]  # nothing from our ranks but the line


def test_check_before_torchrun_exits_2_with_one_line():
    proc = _run(
        [sys.executable, "scripts/train.py", "--config", "configs/signalling_tiny.yaml", "--check", OVERRIDE]
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [LINE], proc.stderr[-3000:]
