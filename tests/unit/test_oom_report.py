"""A rank stopped by torchrun after another was OOM-killed says why in one line.

When the kernel's OOM killer takes a rank (SIGKILL: torchrun prints ``exitcode -9`` and a
``ChildFailedError`` dump), torchrun stops the surviving ranks with SIGTERM. Their preemption flag,
which already handles SIGTERM, compares the machine's ``oom_kill`` count (``/proc/vmstat``) with its
count when the rank started and, when it rose, writes one line naming memory as the cause, this rank's
peak RSS and where the remedies are. A real SIGTERM is delivered to this process; the count is read
from a file in /proc/vmstat's format (the seam), as the kernel cannot be made to OOM-kill here."""

from __future__ import annotations

import os
import signal

from megamarl.runtime.preemption import PreemptionFlag


def _vmstat(path, oom_kills: int) -> None:
    path.write_text(f"nr_free_pages 1\noom_kill {oom_kills}\nnr_zone_active_anon 2\n")


def test_a_sigterm_after_an_oom_kill_says_memory_ran_out(tmp_path, capfd):
    vmstat = tmp_path / "vmstat"
    _vmstat(vmstat, 6)
    flag = PreemptionFlag(vmstat=vmstat)
    try:
        _vmstat(vmstat, 7)  # a rank was OOM-killed
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.received == signal.SIGTERM  # still a preemption: the flag is set as before
    finally:
        flag.uninstall()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[megamarl]")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "[megamarl] rank 0: SIGTERM after the kernel's OOM killer killed 1 process on this machine "
        "(/proc/vmstat oom_kill 6 -> 7) since this rank started: a rank most likely ran out of memory "
        "(torchrun's 'exitcode -9'); this rank's peak RSS "
    ), lines[0]
    assert lines[0].endswith(" GiB; what to lower: docs/troubleshooting.md, 'Running'")


def test_a_sigterm_without_an_oom_kill_says_nothing(tmp_path, capfd):
    vmstat = tmp_path / "vmstat"
    _vmstat(vmstat, 6)
    flag = PreemptionFlag(vmstat=vmstat)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.received == signal.SIGTERM
    finally:
        flag.uninstall()
    assert "[megamarl]" not in capfd.readouterr().err


def test_the_count_at_start_is_kept_by_a_flag_installed_over_another(tmp_path, capfd):
    """scripts/train.py installs a flag first thing, the trainer's loop its own later: a kill between
    the two is still counted (the loop's flag starts from the first one's count)."""
    vmstat = tmp_path / "vmstat"
    _vmstat(vmstat, 6)
    first = PreemptionFlag(vmstat=vmstat)
    _vmstat(vmstat, 8)
    second = PreemptionFlag(vmstat=vmstat)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        second.uninstall()
        first.uninstall()
    assert "killed 2 processes on this machine (/proc/vmstat oom_kill 6 -> 8)" in capfd.readouterr().err
