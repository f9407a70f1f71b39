"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) -> finish the step, checkpoint, exit 0.

The handler only sets a flag; the trainer asks ``PreemptionFlag.agreed()`` at the end of every step,
which all-reduces the flag over the control group, so that when the signal reaches only some ranks
(Slurm signals the processes of one node's step, a user kills one rank) every rank still sees it at
the same step, saves the same checkpoint and leaves the loop together. Without the agreement one
rank would leave the loop while the others wait in the next step's collectives.

What it does not cover: SIGKILL (Slurm's KillWait after SIGTERM, a node loss); periodic checkpoints
(``trainer.save_every``) bound what those lose. ``scripts/slurm/train.sbatch`` requests USR1 ahead of
the time limit and requeues the job, whose next start resumes with ``trainer.resume=auto``.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Installs the handlers (main thread only; elsewhere it never fires) and restores the previous
    ones on ``uninstall``."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.received: signal.Signals | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

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
