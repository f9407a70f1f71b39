"""The signalling env, except that in a requeued Slurm run (``SLURM_RESTART_COUNT`` >= 1) its first
episode waits until this rank has received a SIGUSR1 (at most ``WAIT_S``): Slurm sends the
time-limit warning at its first time-limit check, 0-30 s after the run starts, and a run that starts up
and trains its last step faster than that would finish before it (test harness for
tests/slurm/test_slurm_nodes.py). Outside Slurm, or in a job's first run, it is the signalling env."""

from __future__ import annotations

import os
import signal
import time

from megamarl.orchestration.env import ENVS
from megamarl.orchestration.envs.signalling import SignallingEnv

WAIT_S = 120.0


def _usr1_received() -> bool:
    flag = getattr(signal.getsignal(signal.SIGUSR1), "__self__", None)  # megamarl.runtime.preemption's flag
    return getattr(flag, "received", None) is not None


@ENVS.register("signalling_slurm_warning_wait")
class SlurmWarningWait(SignallingEnv):
    waited = False

    def __init__(self, task, config) -> None:
        super().__init__(task, config)
        if type(self).waited or int(os.environ.get("SLURM_RESTART_COUNT", "0")) < 1:
            return
        type(self).waited = True
        deadline = time.monotonic() + WAIT_S
        while not _usr1_received() and time.monotonic() < deadline:
            time.sleep(0.2)
