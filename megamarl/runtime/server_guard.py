"""Run an inference server and take it down with its owner.

    python -m megamarl.runtime.server_guard --owner PID -- <server command ...>

``ServerProcess`` starts every server in a session of its own (so that ``stop`` can kill the API
server, its engine core and its workers as one process group), which also detaches it from the
owning rank: a rank killed with SIGKILL would leave its server running, holding memory and a port.
This guard sits between the two: it leads the server's process group (``ServerProcess`` starts it
with ``start_new_session``), runs the command in that group, watches the owner, and when the owner
is gone (or on SIGTERM) terminates the group (SIGKILL after a grace period). It exits with the
server's exit code when the server ends first. ``prctl(PR_SET_PDEATHSIG)`` is not
used: it fires when the *thread* that started the child exits, and servers are (re)started from
worker threads (``EnginePool`` restarts). It lives in ``megamarl.runtime``, whose package imports
nothing: ``python -m`` of a module under ``megamarl.rollout`` would first import that package (torch,
transformers and every engine: ~4 CPU-s per server start, for a process that only waits).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 15.0


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _terminate(proc: subprocess.Popen) -> int:
    """SIGTERM the whole process group (the guard ignores it: its handler only sets a flag), then
    SIGKILL it, the guard included, if the server has not exited after ``GRACE_S``."""
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    try:
        return proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        return -signal.SIGKILL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--owner", type=int, required=True, help="PID whose death stops the server")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")
    # Slurm's time-limit warning (USR1) goes to every process of the job step; the trainer's ranks act on
    # it, a server would die of it (the default action). Ignored here, and so in the server, which
    # inherits the disposition through exec.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.Popen(command)  # same process group: ServerProcess.stop's killpg reaches it
    stop = {"requested": False}

    def on_signal(signum, frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        code = proc.poll()
        if code is not None:
            return code
        if stop["requested"] or not _owner_alive(args.owner):
            return _terminate(proc)
        time.sleep(POLL_S)


def _exit_status(code: int) -> int:
    """A child killed by signal N (returncode -N) exits the guard with the shell's 128 + N."""
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(_exit_status(main()))
