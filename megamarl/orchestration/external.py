"""The ``external`` orchestra: an episode is a run of the user's own program, written for the OpenAI API.

``mode: per_episode`` starts ``command`` (or ``python -m module``) once per episode: it reads the job as
JSON on stdin (``{"episode_id", "task_id", "task", "roles", "base_url", "api_key", "reward_url"}``, also
``MEGAMARL_TASK``; ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` are the episode's), calls
``/v1/chat/completions`` with ``model=<role>`` (every call is a Sample of that role,
``openai_endpoint.py``), POSTs ``{"team": r, "agents": {role: r}}`` to the reward URL and exits.
``mode: long_lived`` keeps ``num_workers`` programs running, each reading one job per stdin line and
writing a done line per episode, which may carry the reward (``programs.py``). An episode fails
(counted, samples discarded, within ``rollout.max_failed_fraction``) when its program exits
(``ProgramExitError``), runs past ``timeout_s`` (``ProgramTimeoutError``) or gives no reward
(``NoRewardError``). A program sees an allow-listed environment (``PASS_ENV`` + ``pass_env`` + ``env``),
never the driver's secrets; each episode has its own random key. At most ``max_concurrency`` at once.
Details: docs/design-notes.md, "megamarl/orchestration/external.py".
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import json
import os
import re
import sys
from dataclasses import dataclass, field

from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.openai_endpoint import (
    EndpointError,
    EndpointLimits,
    EpisodeHandle,
    RecordingEndpoint,
)
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig
from megamarl.orchestration.programs import (
    DEFAULT_MAX_START_FAILURES,
    RUNNERS,
    ExternalProgramError,
    NoRewardError,
    ProgramPerEpisode,
    ProgramSpec,
    ProgramWorkers,
)

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
        # per_episode: a program per episode; long_lived: num_workers programs, each serving episode
        # after episode (one JSON job per stdin line, a done line per episode on stdout)
        mode: str = "per_episode"
        num_workers: int = 0  # long_lived: the programs kept running; 0: max_concurrency of them
        timeout_s: float = 300.0  # per episode; the program is killed after it
        max_concurrency: int = 16  # episodes (per_episode: programs) running at once
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
        # long_lived: this many programs in a row that exit (or cannot start) before finishing an
        # episode, none finished in between, stop the run (a crash loop); 0: 3
        max_start_failures: int = 0

        def __post_init__(self) -> None:
            super().__post_init__()  # EndpointLimits
            self.command, self.roles = tuple(str(c) for c in self.command), tuple(self.roles)
            if bool(self.command) == bool(self.module):
                raise ValueError(
                    "orchestra.kwargs: set exactly one of orchestra.command (an argv list) and "
                    f"orchestra.module (a module name); got command={list(self.command)}, "
                    f"module='{self.module}'"
                )
            if self.mode not in RUNNERS:
                raise ValueError(f"orchestra.mode must be one of {sorted(RUNNERS)}, got '{self.mode}'")
            if self.num_workers < 0:
                raise ValueError(f"orchestra.num_workers must be >= 0, got {self.num_workers}")
            if self.num_workers and self.mode != "long_lived":
                raise ValueError(
                    f"orchestra.num_workers is for orchestra.mode=long_lived (got num_workers="
                    f"{self.num_workers} with mode={self.mode}); per_episode runs max_concurrency programs"
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
            if self.max_start_failures < 0:
                raise ValueError(f"orchestra.max_start_failures must be >= 0, got {self.max_start_failures}")
            if self.max_start_failures and self.mode != "long_lived":
                raise ValueError(
                    f"orchestra.max_start_failures is for orchestra.mode=long_lived (got "
                    f"max_start_failures={self.max_start_failures} with mode={self.mode}); a per_episode "
                    "program's failures are its episodes' (rollout.max_failed_fraction)"
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
        # the programs of each event loop (long_lived: its workers, which live as long as the loop)
        self._runners: dict[asyncio.AbstractEventLoop, ProgramPerEpisode | ProgramWorkers] = {}
        self._counters = {"program_starts": 0}

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return self.config.roles or env_roles

    def counters(self) -> dict[str, float]:
        return {key: float(value) for key, value in self._counters.items()}

    def argv(self) -> list[str]:
        if self.config.module:
            return [sys.executable, "-m", self.config.module]
        command = list(self.config.command)
        return [sys.executable, *command[1:]] if command[0] == "python" else command

    def base_environ(self) -> dict[str, str]:
        """What every program gets: the allow-list, ``pass_env``, ``env`` and the driver's sys.path."""
        patterns = (*PASS_ENV, *self.config.pass_env)
        passed = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
        # the program runs with the driver's sys.path, so a module on plugin_paths is found
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        return {
            **passed,
            **self.config.env,
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys([*paths, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
            ),
        }

    def episode_environ(self, job: dict) -> dict[str, str]:
        """A per-episode program's environment: the episode's URL and key, as the official client
        reads them."""
        return {
            **self.base_environ(),
            "OPENAI_BASE_URL": job["base_url"],
            "OPENAI_API_KEY": job["api_key"],  # the episode's key: the endpoint answers nothing without it
            "MEGAMARL_EPISODE_ID": job["episode_id"],
            "MEGAMARL_TASK": json.dumps(job),
            "MEGAMARL_REWARD_URL": job["reward_url"],
        }

    def _runner(self) -> ProgramPerEpisode | ProgramWorkers:
        loop = asyncio.get_running_loop()
        for old in [old for old in self._runners if old.is_closed()]:
            del self._runners[old]
        if loop not in self._runners:
            spec = ProgramSpec(
                argv=tuple(self.argv()),
                cwd=self.config.cwd or None,
                timeout_s=self.config.timeout_s,
                max_stderr_bytes=self.config.max_stderr_bytes,
            )
            self._runners[loop] = RUNNERS[self.config.mode](
                spec,
                counters=self._counters,
                num_workers=self.config.num_workers or self.config.max_concurrency,
                worker_environ=lambda index: {**self.base_environ(), "MEGAMARL_WORKER": str(index)},
                max_start_failures=self.config.max_start_failures or DEFAULT_MAX_START_FAILURES,
            )
        return self._runners[loop]

    async def run(self, ctx: EpisodeContext) -> None:
        loop = asyncio.get_running_loop()
        await self.endpoint.start()
        limit = self._limits.setdefault(loop, asyncio.Semaphore(self.config.max_concurrency))
        url = self.endpoint.episode_url(ctx.episode_id)
        async with limit:
            handle = self.endpoint.open(ctx)
            job = {
                "episode_id": ctx.episode_id,
                "task_id": ctx.task.task_id,
                "task": _payload(ctx.task.payload),
                "roles": list(self.roles(tuple(ctx.env.agents))),
                "base_url": url,
                "api_key": handle.token,
                "reward_url": f"{url}/reward",
            }
            job = json.loads(json.dumps(job, default=str))  # what the program reads
            try:
                done = await self._runner().run(job, self.episode_environ(job))
                if done is not None and "team" in done:  # a long-lived program's reward, in its done line
                    self._report(handle, done)
            finally:
                self.endpoint.close(ctx.episode_id)
        if handle.error is not None:  # e.g. a prompt over budget: the episode is dropped
            raise handle.error
        if handle.reward is None:
            raise NoRewardError(
                f"the program gave no reward: none posted to {url}/reward"
                + (" nor in its done line" if self.config.mode == "long_lived" else "")
                + f" ({handle.num_requests} completions)"
            )

    def _report(self, handle: EpisodeHandle, done: dict) -> None:
        try:
            self.endpoint.report(handle, {"team": done["team"], "agents": done.get("agents") or {}})
        except EndpointError as exc:  # the checks of the reward route: the same bound, once per episode
            raise InvalidRewardError(f"episode {handle.ctx.episode_id}: done line: {exc.message}") from exc


class InvalidRewardError(ExternalProgramError):
    """A done line's reward that the reward route would refuse (not finite, out of bound, a second one)."""
