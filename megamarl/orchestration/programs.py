"""The user's program as a process, for the ``external`` orchestra: once per episode, or long-lived.

``ProgramPerEpisode`` starts the program for one episode (the job as JSON on stdin and in its
environment) and waits for it to exit. ``ProgramWorkers`` keeps ``num_workers`` programs running for
the whole rollout loop: each reads jobs from stdin, one JSON line per episode, and answers each with a
*done line* on stdout (``{"episode_id": ...}``, optionally with the reward), one episode at a time. In
both, a program that exits during its episode fails it (``ProgramExitError``, with the tail of its
stderr), one that runs past ``timeout_s`` is killed and fails it (``ProgramTimeoutError``); a failed
worker loses only its current episode and is started again for its next one, unless it crash-loops:
``max_start_failures`` programs in a row that exit (or cannot start) before finishing an episode, with
none finished in between, stop the run (``ProgramCrashLoopError``, naming the program and its last
stderr lines; supervisord's ``startretries``). Every program runs in
its own process group, killed whole when it ends, fails, or the loop shuts its worker down.
Details: docs/design-notes.md, "megamarl/orchestration/programs.py".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megamarl.errors import ProgramCrashLoopError

_STDERR_GRACE_S = 1.0
MAX_LINE_BYTES = 1024 * 1024  # a longer stdout line (no newline) is dropped, never kept whole
DEFAULT_MAX_START_FAILURES = 3  # orchestra.kwargs.max_start_failures=0 (supervisord's startretries)


class ExternalProgramError(RuntimeError):
    """The episode's program failed; the episode is counted as failed (reason ``error:<class>``)."""


class ProgramExitError(ExternalProgramError):
    pass


class ProgramTimeoutError(ExternalProgramError):
    pass


class NoRewardError(ExternalProgramError):
    pass


class _Cancelled(ExternalProgramError):
    """The episode a long-lived program was serving was cancelled: the program's state is lost."""


class DoneLineError(ExternalProgramError):
    """A long-lived program's done line named another episode than the one it was serving."""


@dataclass(frozen=True)
class ProgramSpec:
    """How to start the program: its argv, working directory and stderr cap (``External.Config``)."""

    argv: tuple[str, ...]
    cwd: str | None
    timeout_s: float
    max_stderr_bytes: int


class _Program(asyncio.SubprocessProtocol):
    """The program's process as the loop sees it: its exit, its pipes' end, the tail of its stderr and
    (a long-lived program) its stdout lines."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_stderr_bytes: int) -> None:
        self.limit = max_stderr_bytes
        self.tail, self.dropped = bytearray(), 0
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()  # exited and every pipe closed
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._partial, self._overlong = bytearray(), False

    def pipe_data_received(self, fd: int, data: bytes | bytearray) -> None:
        if fd == 1:
            self._stdout(data)
            return
        self.tail += data  # stderr: only its last ``limit`` bytes are kept
        if len(self.tail) > self.limit:
            self.dropped += len(self.tail) - self.limit
            del self.tail[: len(self.tail) - self.limit]

    def _stdout(self, data: bytes | bytearray) -> None:
        *complete, rest = bytes(data).split(b"\n")
        for piece in complete:
            if not self._overlong:
                self.lines.put_nowait(bytes(self._partial + piece))
            self._partial, self._overlong = bytearray(), False
        if not self._overlong:
            self._partial += rest
            if len(self._partial) > MAX_LINE_BYTES:  # not a done line: dropped up to its newline
                self._partial, self._overlong = bytearray(), True

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def exit_error(self, returncode: int | None, what: str) -> ProgramExitError:
        lines = self.tail.decode(errors="replace").strip().splitlines()[-15:]
        skipped = f" (the first {self.dropped} bytes of its stderr not kept)" if self.dropped else ""
        return ProgramExitError(f"{what} exited with {returncode}{skipped}:\n" + "\n".join(lines))


async def _spawn(
    spec: ProgramSpec, environ: dict[str, str], *, stdout: int
) -> tuple[asyncio.SubprocessTransport, _Program]:
    loop = asyncio.get_running_loop()
    transport, program = await loop.subprocess_exec(
        lambda: _Program(loop, spec.max_stderr_bytes),
        *spec.argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
        env=environ,
        cwd=spec.cwd,
        start_new_session=True,
    )  # its own process group: killed whole when the program ends
    return transport, program


def _send_job(transport: asyncio.SubprocessTransport, data: bytes, *, close: bool = False) -> None:
    stdin = transport.get_pipe_transport(0)
    assert isinstance(stdin, asyncio.WriteTransport)
    stdin.write(data)  # buffered by the loop: a program that never reads cannot block it
    if close:
        stdin.close()


async def _end(transport: asyncio.SubprocessTransport, program: _Program) -> None:
    """Kill the program's whole group and close its transport (every path: nothing it started survives)."""
    _kill_leftovers(transport.get_pid())
    # the group is dead, so stderr ends at once, unless a process that left the group (setsid) holds
    # it: the tail is not worth waiting longer for
    await asyncio.wait({program.exited, program.closed}, timeout=_STDERR_GRACE_S)
    transport.close()


def _kill_leftovers(pgid: int) -> None:
    # the group outlives its leader while any member lives, so its id is not reused meanwhile; once
    # empty, the leader was reaped only this loop iteration ago (a pid is reused after pid_max others)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: nothing was left behind
        pass


class ProgramPerEpisode:
    """A program per episode: the job on stdin (closed after it) and in ``environ``; its exit ends it."""

    def __init__(self, spec: ProgramSpec, *, counters: dict[str, int], **_: object) -> None:
        self.spec, self.counters = spec, counters

    async def run(self, job: dict, environ: dict[str, str]) -> dict | None:
        transport, program = await _spawn(self.spec, environ, stdout=asyncio.subprocess.DEVNULL)
        self.counters["program_starts"] += 1
        try:
            _send_job(transport, json.dumps(job).encode(), close=True)
            # the program's own exit, not its pipes' end: a child it left behind may hold stderr open
            exited, _ = await asyncio.wait({program.exited}, timeout=self.spec.timeout_s)
            if not exited:
                raise ProgramTimeoutError(
                    f"episode {job['episode_id']}: the program ran longer than "
                    f"orchestra.timeout_s={self.spec.timeout_s} s and was killed"
                )
        finally:
            await _end(transport, program)
        returncode = transport.get_returncode()
        if returncode != 0:
            raise program.exit_error(returncode, f"episode {job['episode_id']}: {list(self.spec.argv)}")
        return None


class ProgramWorkers:
    """``num_workers`` long-lived programs on the running loop, each serving one episode at a time.

    A worker is a task that owns its program: started with the pool, started again for the next job
    after it failed or exited, killed with its group when the loop cancels the task (the rollout's end).
    ``run`` queues a job and waits for its done line."""

    def __init__(
        self,
        spec: ProgramSpec,
        *,
        counters: dict[str, int],
        num_workers: int,
        worker_environ: Callable[[int], dict[str, str]],
        max_start_failures: int,
    ) -> None:
        self.spec, self.counters, self.worker_environ = spec, counters, worker_environ
        self.max_start_failures = max_start_failures
        self.num_start_failures = 0  # programs in a row that ended before finishing an episode
        self.crash_loop: ProgramCrashLoopError | None = None  # set: every job fails with it, none starts
        self.jobs: asyncio.Queue[tuple[dict, asyncio.Future[dict]]] = asyncio.Queue()
        self.workers = [asyncio.ensure_future(self._serve(index)) for index in range(num_workers)]

    async def run(self, job: dict, environ: dict[str, str]) -> dict | None:
        done: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        await self.jobs.put((job, done))
        return await done  # cancelled (the episode is): the worker kills its program, starts it again

    async def _serve(self, index: int) -> None:
        started: tuple[asyncio.SubprocessTransport, _Program] | None = None
        done: asyncio.Future[dict] | None = None
        num_served = 0  # episodes the running program finished
        with contextlib.suppress(OSError):  # a command that cannot start: each job reports it
            started = await self._start(index)  # at once: the programs' imports overlap
        try:
            while True:
                job, done = await self.jobs.get()
                if done.done():  # the episode was cancelled while queued
                    continue
                try:
                    if self.crash_loop is not None:  # a fresh error per job: one traceback each
                        raise ProgramCrashLoopError(*self.crash_loop.args)
                    if started is None or started[1].exited.done():  # failed, or exited between jobs
                        if started is not None:
                            await _end(*started)
                            if not num_served:  # it exited before its first job was done
                                what = f"worker {list(self.spec.argv)}"
                                self._start_failed(started[1].exit_error(started[0].get_returncode(), what))
                        started, num_served = None, 0
                        started = await self._start(index)
                    answer = await self._episode(*started, job, done)
                    num_served, self.num_start_failures = num_served + 1, 0
                    if not done.done():
                        done.set_result(answer)
                # the episode's failure (or its cancellation: _Cancelled), never the worker's end; the
                # worker's own cancellation (the loop's end) is not an Exception: ``finally`` kills
                except Exception as exc:  # noqa: BLE001
                    if started is not None:
                        await _end(*started)
                    started = None
                    if isinstance(exc, (ProgramExitError, OSError)) and not num_served:
                        exc = self._start_failed(exc)
                    if not done.done():
                        done.set_exception(exc)
        finally:
            if done is not None:
                done.cancel()  # no-op unless the worker ends mid-episode
            if started is not None:
                await _end(*started)

    def _start_failed(self, exc: Exception) -> Exception:
        """A program exited (or could not start) before finishing an episode: counted; the
        ``max_start_failures``-th in a row stops the run (``crash_loop``, the error every job gets)."""
        self.num_start_failures += 1
        if self.crash_loop is None and self.num_start_failures >= self.max_start_failures:
            self.crash_loop = ProgramCrashLoopError(
                f"orchestra.kwargs.mode=long_lived: the program {list(self.spec.argv)} exited before "
                f"finishing an episode {self.num_start_failures} times in a row, no episode finished in "
                f"between (orchestra.kwargs.max_start_failures={self.max_start_failures}); the run stops. "
                f"The last: {exc}"
            )
        return self.crash_loop or exc

    async def _start(self, index: int) -> tuple[asyncio.SubprocessTransport, _Program]:
        started = await _spawn(self.spec, self.worker_environ(index), stdout=asyncio.subprocess.PIPE)
        self.counters["program_starts"] += 1
        return started

    async def _episode(
        self, transport: asyncio.SubprocessTransport, program: _Program, job: dict, done: asyncio.Future
    ) -> dict:
        episode_id = job["episode_id"]
        what = f"episode {episode_id}: worker {list(self.spec.argv)}"
        _send_job(transport, json.dumps(job).encode() + b"\n")
        deadline = asyncio.get_running_loop().time() + self.spec.timeout_s
        while True:
            line = asyncio.ensure_future(program.lines.get())
            left = deadline - asyncio.get_running_loop().time()
            waited: set[asyncio.Future[Any]] = {line, program.exited, done}
            try:
                await asyncio.wait(waited, timeout=max(left, 0), return_when="FIRST_COMPLETED")
            finally:
                line.cancel()
            if done.done():
                raise _Cancelled(f"{what}: the episode was cancelled; its program is started again")
            if line.done() and not line.cancelled():
                answer = _done_line(line.result())
                if answer is None:
                    continue  # not a done line (the program printed something else)
                if answer["episode_id"] != episode_id:
                    raise DoneLineError(f"{what} answered episode {answer['episode_id']!r} instead")
                return answer
            if program.exited.done():
                raise program.exit_error(transport.get_returncode(), what)
            raise ProgramTimeoutError(
                f"{what} gave no done line within orchestra.timeout_s={self.spec.timeout_s} s and was killed"
            )


def _done_line(line: bytes) -> dict | None:
    """A JSON object with an ``episode_id``, or None for any other line of the program's stdout."""
    try:
        answer = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(answer, dict) or "episode_id" not in answer:
        return None
    answer["episode_id"] = str(answer["episode_id"])
    return answer


# orchestra.mode -> how programs run
RUNNERS: dict[str, type[ProgramPerEpisode | ProgramWorkers]] = {
    "per_episode": ProgramPerEpisode,
    "long_lived": ProgramWorkers,
}
