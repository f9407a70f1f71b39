"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) -> finish the step, checkpoint, exit 0.

The handler only sets a flag; at the end of every step the trainer asks ``PreemptionFlag.agreed()``,
which all-reduces it over the control group, so every rank stops at the same step with the same
checkpoint even when only some ranks got the signal. A signal before the loop (``scripts/train.py``
installs a flag first thing) is held and stops the run after its first step, so a job warned during
start-up still saves progress. A run stopped by a signal leaves ``<run_dir>/PREEMPTED`` (the step it
saved), which ``scripts/slurm/train.sbatch`` reads to decide a requeue. Not covered: SIGKILL;
``trainer.save_every`` bounds what that loses.
Details: docs/design-notes.md, "megamarl/runtime/preemption.py".
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MARKER = "PREEMPTED"  # in the run directory: the last run stopped on a signal (see the module docstring)


class PreemptionFlag:
    """Installs the handlers (main thread only; elsewhere it never fires) and restores the previous
    ones on ``uninstall``. A flag installed over another one (the loop's over ``scripts/train.py``'s)
    starts with the signal that one received: nothing that arrived during start-up is lost."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.received: signal.Signals | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                held = getattr(self._previous[sig], "__self__", None)
                if self.received is None and isinstance(held, PreemptionFlag):
                    self.received = held.received

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum)

    def agreed(self, group) -> bool:
        """Collective over ``group``: True on every rank when any rank received a signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def mark_stopped(run_dir: Path, *, step: int, received: signal.Signals | None) -> None:
    """The driver, once the checkpoint of ``step`` is saved: ``<run_dir>/PREEMPTED`` says that this run
    stopped early on a signal (what a batch script reads before it requeues the job)."""
    marker = Path(run_dir) / MARKER
    marker.write_text(
        json.dumps({"step": step, "signal": received.name if received else "another rank"}) + "\n"
    )
