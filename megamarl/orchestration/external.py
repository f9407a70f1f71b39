"""The ``external`` orchestra: an episode is a run of the user's own program, written for the OpenAI API.

The orchestra starts ``command`` (or ``python -m module``) once per episode. The program reads the task
as JSON on stdin (``{"episode_id", "task_id", "task", "roles"}``, also ``MEGAMARL_TASK``), calls
``/v1/chat/completions`` at ``OPENAI_BASE_URL`` with ``model=<role>`` (every call is a Sample of that
role, ``openai_endpoint.py``), POSTs ``{"team": r, "agents": {role: r}}`` to ``MEGAMARL_REWARD_URL`` and
exits. It fails (counted, samples discarded, within ``rollout.max_failed_fraction``) on a non-zero exit
(``ProgramExitError``), past ``timeout_s`` (process group killed; ``ProgramTimeoutError``) or with no
reward (``NoRewardError``). At most ``max_concurrency`` programs run at once.
Details: docs/design-notes.md, "megamarl/orchestration/external.py".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass, field

from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.openai_endpoint import RecordingEndpoint
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig


class ExternalProgramError(RuntimeError):
    """The episode's program failed; the episode is counted as failed (reason ``error:<class>``)."""


class ProgramExitError(ExternalProgramError):
    pass


class ProgramTimeoutError(ExternalProgramError):
    pass


class NoRewardError(ExternalProgramError):
    pass


def _payload(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@ORCHESTRAS.register("external")
class External(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
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
        cwd: str = ""  # the program's working directory; empty: the run's

        def __post_init__(self) -> None:
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
            if self.cwd and not os.path.isdir(self.cwd):
                raise ValueError(f"orchestra.cwd '{self.cwd}' is not a directory")

    config: Config  # the registry builds each orchestra with its own Config

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.endpoint = RecordingEndpoint(host=self.config.host, port=self.config.port)
        self._limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return self.config.roles or env_roles

    def argv(self) -> list[str]:
        if self.config.module:
            return [sys.executable, "-m", self.config.module]
        command = list(self.config.command)
        return [sys.executable, *command[1:]] if command[0] == "python" else command

    def environ(self, ctx: EpisodeContext, task_json: str) -> dict[str, str]:
        # the program runs with the driver's sys.path, so a module on plugin_paths is found
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        return {
            **os.environ,
            **self.config.env,
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys([*paths, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
            ),
            "OPENAI_BASE_URL": self.endpoint.episode_url(ctx.episode_id),
            "OPENAI_API_KEY": "megamarl",
            "MEGAMARL_EPISODE_ID": ctx.episode_id,
            "MEGAMARL_TASK": task_json,
            "MEGAMARL_REWARD_URL": f"{self.endpoint.episode_url(ctx.episode_id)}/reward",
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
                await self._run_program(ctx, task_json)
            finally:
                self.endpoint.close(ctx.episode_id)
        if handle.error is not None:  # e.g. a prompt over budget: the episode is dropped
            raise handle.error
        if handle.reward is None:
            raise NoRewardError(
                f"the program exited without posting a reward to "
                f"{self.endpoint.episode_url(ctx.episode_id)}/reward ({handle.num_requests} completions)"
            )

    async def _run_program(self, ctx: EpisodeContext, task_json: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=self.environ(ctx, task_json),
            cwd=self.config.cwd or None,
            start_new_session=True,
        )  # its own process group: a timeout kills what it started too
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(task_json.encode()), self.config.timeout_s)
        except asyncio.TimeoutError:
            raise ProgramTimeoutError(
                f"episode {ctx.episode_id}: the program ran longer than "
                f"orchestra.timeout_s={self.config.timeout_s} s and was killed"
            ) from None
        finally:
            if proc.returncode is None:  # timed out or cancelled (the episode's own timeout)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-15:]
            raise ProgramExitError(
                f"episode {ctx.episode_id}: {self.argv()} exited with {proc.returncode}:\n" + "\n".join(tail)
            )
