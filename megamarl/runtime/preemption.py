"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) -> finish the step, checkpoint, exit 0.

The handler only sets a flag; at the end of every step the trainer asks ``PreemptionFlag.agreed()``,
which all-reduces it over the control group, so every rank stops at the same step with the same
checkpoint even when only some ranks got the signal. A signal before the loop (``scripts/train.py``
installs a flag first thing) is held and stops the run after its first step, so a job warned during
start-up still saves progress. A run stopped by a signal leaves ``<run_dir>/PREEMPTED`` (the step it
saved), which ``scripts/slurm/train.sbatch`` reads to decide a requeue. Not covered: SIGKILL;
``trainer.save_every`` bounds what that loses. A SIGTERM after the kernel's OOM killer struck (the
machine's ``oom_kill`` count rose since the rank started) is torchrun stopping the survivors of an
OOM-killed rank: the handler says so in one line, as torchrun's own report says only ``exitcode -9``.
Details: docs/design-notes.md, "megamarl/runtime/preemption.py".
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
VMSTAT = Path("/proc/vmstat")  # its oom_kill line: processes the kernel's OOM killer killed (since 4.13)
MARKER = "PREEMPTED"  # in the run directory: the last run stopped on a signal (see the module docstring)


class PreemptionFlag:
    """Installs the handlers (main thread only; elsewhere it never fires) and restores the previous
    ones on ``uninstall``. A flag installed over another one (the loop's over ``scripts/train.py``'s)
    starts with the signal that one received: nothing that arrived during start-up is lost."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS, *, vmstat: Path = VMSTAT) -> None:
        self.received: signal.Signals | None = None
        self._previous = {}
        self._vmstat = vmstat
        self._oom_kills = oom_kill_count(vmstat)  # the machine's count when this rank started
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                held = getattr(self._previous[sig], "__self__", None)
                if isinstance(held, PreemptionFlag):
                    self.received = self.received or held.received
                    if held._vmstat == vmstat:  # the same count, read earlier: kills since then count
                        self._oom_kills = held._oom_kills

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum)
        if self.received == signal.SIGTERM:
            line = oom_line(self._oom_kills, oom_kill_count(self._vmstat))
            if line:  # os.write: print() may be inside a write of its own when the signal lands
                os.write(2, (line + "\n").encode())

    def agreed(self, group) -> bool:
        """Collective over ``group``: True on every rank when any rank received a signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def stopped(self, run_dir: Path, *, step: int, requeue: bool) -> str:
        """The run stops after saving ``step``: ``PREEMPTED`` written (``requeue``: on the driver, unless
        ``eval.stop_at`` ended it, when there is nothing to requeue); returns the line to say."""
        if requeue:
            mark_stopped(run_dir, step=step, received=self.received)  # for train.sbatch
        by = self.received.name if self.received else "another rank"
        return f"preempted ({by}): saved step {step}; trainer.resume=auto continues from it"

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def oom_kill_count(vmstat: Path = VMSTAT) -> int | None:
    """The machine's ``oom_kill`` count (None where the kernel does not report it)."""
    try:
        for line in vmstat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_line(at_start: int | None, now: int | None) -> str:
    """The one line for a SIGTERM that follows OOM kills ('' when the count did not rise)."""
    if at_start is None or now is None or now <= at_start:
        return ""
    num = now - at_start
    peak = _peak_rss_gib()
    return (
        f"[megamarl] rank {os.environ.get('RANK', '0')}: SIGTERM after the kernel's OOM killer killed {num} "
        f"process{'es' if num > 1 else ''} on this machine (/proc/vmstat oom_kill {at_start} -> {now}) since "
        "this rank started: a rank most likely ran out of memory (torchrun's 'exitcode -9'); this rank's "
        f"peak RSS {peak} GiB; what to lower: docs/troubleshooting.md, 'Running'"
    )


def _peak_rss_gib() -> str:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return f"{int(line.split()[1]) / 2**20:.1f}"
    except (OSError, ValueError):
        pass
    return "?"


def mark_stopped(run_dir: Path, *, step: int, received: signal.Signals | None) -> None:
    """The driver, once the checkpoint of ``step`` is saved: ``<run_dir>/PREEMPTED`` says that this run
    stopped early on a signal (what a batch script reads before it requeues the job)."""
    marker = Path(run_dir) / MARKER
    marker.write_text(
        json.dumps({"step": step, "signal": received.name if received else "another rank"}) + "\n"
    )
