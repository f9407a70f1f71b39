"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) -> finish the step, checkpoint, exit 0.

The handler only sets a flag; the trainer asks ``PreemptionFlag.agreed()`` at the end of every step,
which all-reduces the flag over the control group, so that when the signal reaches only some ranks
(Slurm signals the processes of one node's step, a user kills one rank) every rank still sees it at
the same step, saves the same checkpoint and leaves the loop together. Without the agreement one
rank would leave the loop while the others wait in the next step's collectives.

A signal that arrives before the loop starts (model loading, engine start-up, the step-0 eval) is
held, not lost: ``scripts/train.py`` installs a flag first thing, and the loop's flag takes over what
that one received. The run then stops at the end of its first step, not at once: a Slurm job warned
during start-up (its time limit near, ``--signal=B:USR1@180``) still saves one more step, and the
requeued job then makes progress instead of being warned again before it ever trains.

A run that stopped on a signal leaves ``<run_dir>/PREEMPTED`` (the step it saved) next to its
checkpoint: ``scripts/slurm/train.sbatch`` requeues the job only when its ranks left that marker,
exited 0 and saved a step below ``trainer.total_steps`` (never a finished run, nor one that
``eval.stop_at`` ended), and removes it before each launch.

What it does not cover: SIGKILL (Slurm's KillWait after SIGTERM, a node loss); periodic checkpoints
(``trainer.save_every``) bound what those lose.
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
