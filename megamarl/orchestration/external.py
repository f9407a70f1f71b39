"""The ``external`` orchestra: an episode is a run of the user's own program, written for the OpenAI API.

The orchestra starts ``command`` (or ``python -m module``) once per episode. The program reads the task
as JSON on stdin (``{"episode_id", "task_id", "task", "roles"}``, also ``MEGAMARL_TASK``), calls
``/v1/chat/completions`` at ``OPENAI_BASE_URL`` with ``model=<role>`` (every call is a Sample of that
role, ``openai_endpoint.py``), POSTs ``{"team": r, "agents": {role: r}}`` to ``MEGAMARL_REWARD_URL`` and
exits. It fails (counted, samples discarded, within ``rollout.max_failed_fraction``) on a non-zero exit
(``ProgramExitError``, with the tail of its stderr: at most ``max_stderr_bytes`` are kept), past
``timeout_s`` (``ProgramTimeoutError``) or with no reward (``NoRewardError``). Whatever way it ends, its
whole process group is killed, so nothing it started outlives the episode. It sees an allow-listed
environment (``PASS_ENV`` + ``pass_env`` + ``env`` + the episode's own variables, ``OPENAI_API_KEY``
being the episode's random key), never the driver's secrets. At most ``max_concurrency`` at once.
Details: docs/design-notes.md, "megamarl/orchestration/external.py".
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field

from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.openai_endpoint import EndpointLimits, EpisodeHandle, RecordingEndpoint
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig


class ExternalProgramError(RuntimeError):
    """The episode's program failed; the episode is counted as failed (reason ``error:<class>``)."""


class ProgramExitError(ExternalProgramError):
    pass


class ProgramTimeoutError(ExternalProgramError):
    pass


class NoRewardError(ExternalProgramError):
    pass


# the driver's variables a program gets without asking: what an interpreter and its libraries need to
# start and find files, nothing that names a credential (tokens, cloud keys, proxies with passwords)
PASS_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TERM",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "SLURM_*",  # a command of `srun -w <node> ...` runs as a step of the driver's job only with these
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
_STDERR_GRACE_S = 1.0


def _payload(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@ORCHESTRAS.register("external")
class External(Orchestra):
    agent_kind = "text"  # the program's replies are its own: every non-empty one is valid, unparsed

    @dataclass
    class Config(OrchestraConfig, EndpointLimits):  # the endpoint's limits are keys of the orchestra
        command: tuple[str, ...] = ()  # argv; a first element "python" is the run's interpreter
        module: str = ""  # or: run ``python -m module`` (found on plugin_paths / sys.path)
        roles: tuple[str, ...] = ()  # roles the program calls (each needs agents.<role>); empty: the env's
        timeout_s: float = 300.0  # per episode; the program is killed after it
        max_concurrency: int = 16  # programs running at once
        # a program may run on another node: advertised at this node's address
        # (parallel.network.listen_address)
        host: str = ""  # the endpoint's bind address; "" (auto): 127.0.0.1 on one node, 0.0.0.0 on several
        port: int = 0  # the endpoint's port; 0: a free one, chosen at the first episode
        env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the program
        # the driver's variables the program also gets, beyond external.PASS_ENV (PATH, HOME, LANG,
        # LC_*, ...): names, or prefixes ending in * (HF_*); the rest of the driver's environment is not
        # passed
        pass_env: tuple[str, ...] = ()
        cwd: str = ""  # the program's working directory; empty: the run's
        max_stderr_bytes: int = 64 * 1024  # the tail of the program's stderr kept (for the episode's error)

        def __post_init__(self) -> None:
            super().__post_init__()  # EndpointLimits
            self.command, self.roles = tuple(str(c) for c in self.command), tuple(self.roles)
            if bool(self.command) == bool(self.module):
                raise ValueError(
                    "orchestra.kwargs: set exactly one of orchestra.command (an argv list) and "
                    f"orchestra.module (a module name); got command={list(self.command)}, "
                    f"module='{self.module}'"
                )
            if not self.timeout_s > 0:
                raise ValueError(f"orchestra.timeout_s must be > 0, got {self.timeout_s}")
            if self.max_concurrency < 1:
                raise ValueError(f"orchestra.max_concurrency must be >= 1, got {self.max_concurrency}")
            if not 0 <= self.port < 65536:
                raise ValueError(f"orchestra.port must be in [0, 65535], got {self.port}")
            self.env = {str(k): str(v) for k, v in self.env.items()}
            self.pass_env = tuple(str(name) for name in self.pass_env)
            bad = [name for name in self.pass_env if not _ENV_NAME.fullmatch(name)]
            if bad:
                raise ValueError(
                    f"orchestra.pass_env: {bad} are not variable names (or prefixes ending in *)"
                )
            if self.max_stderr_bytes < 0:
                raise ValueError(f"orchestra.max_stderr_bytes must be >= 0, got {self.max_stderr_bytes}")
            if self.cwd and not os.path.isdir(self.cwd):
                raise ValueError(f"orchestra.cwd '{self.cwd}' is not a directory")

    config: Config  # the registry builds each orchestra with its own Config

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.endpoint = RecordingEndpoint(host=self.config.host, port=self.config.port, limits=self.config)
        self._limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return self.config.roles or env_roles

    def argv(self) -> list[str]:
        if self.config.module:
            return [sys.executable, "-m", self.config.module]
        command = list(self.config.command)
        return [sys.executable, *command[1:]] if command[0] == "python" else command

    def environ(self, handle: EpisodeHandle, task_json: str) -> dict[str, str]:
        patterns = (*PASS_ENV, *self.config.pass_env)
        passed = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
        # the program runs with the driver's sys.path, so a module on plugin_paths is found
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        url = self.endpoint.episode_url(handle.ctx.episode_id)
        return {
            **passed,
            **self.config.env,
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys([*paths, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
            ),
            "OPENAI_BASE_URL": url,
            "OPENAI_API_KEY": handle.token,  # the episode's key: the endpoint answers nothing without it
            "MEGAMARL_EPISODE_ID": handle.ctx.episode_id,
            "MEGAMARL_TASK": task_json,
            "MEGAMARL_REWARD_URL": f"{url}/reward",
        }

    async def run(self, ctx: EpisodeContext) -> None:
        loop = asyncio.get_running_loop()
        await self.endpoint.start()
        limit = self._limits.setdefault(loop, asyncio.Semaphore(self.config.max_concurrency))
        task_json = json.dumps(
            {
                "episode_id": ctx.episode_id,
                "task_id": ctx.task.task_id,
                "task": _payload(ctx.task.payload),
                "roles": list(self.roles(tuple(ctx.env.agents))),
            },
            default=str,
        )
        async with limit:
            handle = self.endpoint.open(ctx)
            try:
                await self._run_program(handle, task_json)
            finally:
                self.endpoint.close(ctx.episode_id)
        if handle.error is not None:  # e.g. a prompt over budget: the episode is dropped
            raise handle.error
        if handle.reward is None:
            raise NoRewardError(
                f"the program exited without posting a reward to "
                f"{self.endpoint.episode_url(ctx.episode_id)}/reward ({handle.num_requests} completions)"
            )

    async def _run_program(self, handle: EpisodeHandle, task_json: str) -> None:
        episode_id = handle.ctx.episode_id
        loop = asyncio.get_running_loop()
        transport, program = await loop.subprocess_exec(
            lambda: _Program(loop, self.config.max_stderr_bytes),
            *self.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=self.environ(handle, task_json),
            cwd=self.config.cwd or None,
            start_new_session=True,
        )  # its own process group: killed whole when the program ends
        try:
            stdin = transport.get_pipe_transport(0)
            assert isinstance(stdin, asyncio.WriteTransport)
            stdin.write(
                task_json.encode()
            )  # buffered by the loop: a program that never reads cannot block it
            stdin.close()
            # the program's own exit, not its pipes' end: a child it left behind may hold stderr open
            exited, _ = await asyncio.wait({program.exited}, timeout=self.config.timeout_s)
            if not exited:
                raise ProgramTimeoutError(
                    f"episode {episode_id}: the program ran longer than "
                    f"orchestra.timeout_s={self.config.timeout_s} s and was killed"
                )
        finally:  # every path (exit 0 too, a timeout, the episode cancelled): nothing it started survives
            _kill_leftovers(transport.get_pid())
            # the group is dead, so stderr ends at once, unless a process that left the group (setsid)
            # holds it: the tail is not worth waiting longer for
            await asyncio.wait({program.exited, program.closed}, timeout=_STDERR_GRACE_S)
            transport.close()
        returncode = transport.get_returncode()
        if returncode != 0:
            lines = program.tail.decode(errors="replace").strip().splitlines()[-15:]
            skipped = (
                f" (the first {program.dropped} bytes of its stderr not kept)" if program.dropped else ""
            )
            raise ProgramExitError(
                f"episode {episode_id}: {self.argv()} exited with {returncode}{skipped}:\n" + "\n".join(lines)
            )


class _Program(asyncio.SubprocessProtocol):
    """The program's process as the loop sees it: its exit, its pipes' end, the tail of its stderr."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_stderr_bytes: int) -> None:
        self.limit = max_stderr_bytes
        self.tail, self.dropped = bytearray(), 0
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()  # exited and every pipe closed

    def pipe_data_received(self, fd: int, data: bytes | bytearray) -> None:
        self.tail += data  # stderr, the only pipe it writes to; only its last ``limit`` bytes are kept
        if len(self.tail) > self.limit:
            self.dropped += len(self.tail) - self.limit
            del self.tail[: len(self.tail) - self.limit]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _kill_leftovers(pgid: int) -> None:
    # the group outlives its leader while any member lives, so its id is not reused meanwhile; once
    # empty, the leader was reaped only this loop iteration ago (a pid is reused after pid_max others)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: nothing was left behind
        pass
