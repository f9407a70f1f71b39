"""``tool_relay``: a signalling game played through slow tools, the workload of ``scripts/bench_async.py``.

The caller sees a secret digit and for ``num_rounds`` rounds (drawn per task from ``rounds``) sends a
letter through a relay tool; the answerer sees the last letter delivered and names the digit (team
reward 1). Tools have real latency: ``wait`` (``wait_s`` times a seeded factor) and ``python`` (an
env-written program in a fresh ``python -I -S``), awaited on the rollout event loop by the
``tool_calls`` orchestra. ``slow_judge``: the same game with a blocking judge per step (``judge_s``,
``remote_step``), the workload of ``scripts/bench_env_workers.py``: inline it blocks the loop, in env
workers the judges overlap. Import as a plugin (``plugins: [megamarl.orchestration.envs.latency]``).
Details: docs/design-notes.md, "megamarl/orchestration/envs/latency.py".
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import ClassVar

from megamarl.orchestration.context import ConfigError, EpisodeContext
from megamarl.orchestration.env import ENVS, ConfigT, Env, EnvConfig, StepResult, Task
from megamarl.orchestration.envs.signalling import SYMBOLS, SignallingConfig, SignallingEnv
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig

TOOL_KINDS = ("wait", "python")


@dataclass(frozen=True)
class ToolCall:
    kind: str  # wait | python
    seconds: float = 0.0  # wait: how long the tool takes
    code: str = ""  # python: the program; it prints ``expected``
    expected: str = ""


@dataclass(frozen=True)
class RelayTask:
    secret: int
    calls: tuple[ToolCall, ...]  # one per round


@dataclass
class ToolRelayConfig(EnvConfig):
    rounds: list[int] = field(default_factory=lambda: [1, 1, 1, 1, 2, 2, 3, 4, 6, 10])  # drawn per task
    wait_s: float = 0.3  # mean latency of a wait tool
    code_fraction: float = 0.2  # share of tool calls that run a python program
    code_iters: int = 20_000  # loop length of the python program (its CPU time)

    def __post_init__(self) -> None:
        if not self.rounds or min(self.rounds) < 1:
            raise ValueError(f"env.rounds must be a non-empty list of counts >= 1, got {self.rounds}")
        if self.wait_s < 0:
            raise ValueError(f"env.wait_s must be >= 0, got {self.wait_s}")
        if not 0 <= self.code_fraction <= 1:
            raise ValueError(f"env.code_fraction must be in [0, 1], got {self.code_fraction}")
        if self.code_iters < 1:
            raise ValueError(f"env.code_iters must be >= 1, got {self.code_iters}")


def _program(rng: random.Random, iters: int) -> ToolCall:
    offset = rng.randrange(1000)
    code = f"print(sum(i * i + {offset} for i in range({iters})) % 9973)"
    return ToolCall("python", code=code, expected=str(sum(i * i + offset for i in range(iters)) % 9973))


class ToolEnv(Env[ConfigT]):
    """An env whose agent actions may leave a tool call for the orchestra to execute."""

    def pending_call(self) -> ToolCall | None:
        raise NotImplementedError

    def finish_call(self, output: str) -> None:
        raise NotImplementedError


@ENVS.register("tool_relay")
class ToolRelayEnv(ToolEnv[ToolRelayConfig]):
    Config = ToolRelayConfig
    agents = ("caller", "answerer")
    default_agents: ClassVar[dict[str, str]] = {"caller": "signal_sender", "answerer": "signal_receiver"}

    def __init__(self, task: Task, config: ToolRelayConfig) -> None:
        super().__init__(task, config)
        self.relay: RelayTask = task.payload
        self.round = 0
        self.pending: tuple[str, ToolCall] | None = None  # (letter sent, its tool call)
        self.delivered = "?"
        self.guess: int | None = None

    @classmethod
    def generate_tasks(cls, config: ToolRelayConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        secrets = [i % 10 for i in range(num_tasks)]
        rng.shuffle(secrets)
        tasks = []
        for i, secret in enumerate(secrets):
            calls = []
            for _ in range(rng.choice(config.rounds)):
                if rng.random() < config.code_fraction:
                    calls.append(_program(rng, config.code_iters))
                else:
                    calls.append(
                        ToolCall("wait", seconds=config.wait_s * rng.uniform(0.5, 1.5), expected="ok")
                    )
            tasks.append(Task(f"relay-{seed}-{i}", RelayTask(secret, tuple(calls))))
        return tasks

    def active_agents(self) -> list[str]:
        if self.done or self.pending is not None:
            return []
        return ["caller"] if self.round < len(self.relay.calls) else ["answerer"]

    def observe(self, agent: str) -> str:
        if agent == "caller":
            return (
                f"The secret digit is {self.relay.secret}. Relay round {self.round + 1} of "
                f"{len(self.relay.calls)}: send exactly one letter from {' '.join(SYMBOLS)}."
            )
        return (
            f"The relay delivered the letter: {self.delivered}\n"
            "Which digit (0-9) is the secret? Reply with one digit."
        )

    def step(self, agent: str, action) -> StepResult:
        if agent == "caller":
            self.pending = (action.value if action.valid else "?", self.relay.calls[self.round])
            return StepResult()
        self.guess = int(action.value) if action.valid else None
        self.done = True
        return StepResult()

    def pending_call(self) -> ToolCall | None:
        return None if self.pending is None else self.pending[1]

    def finish_call(self, output: str) -> None:
        assert self.pending is not None  # called for the call pending_call() returned
        letter, call = self.pending
        self.delivered = letter if output == call.expected else "?"
        self.pending = None
        self.round += 1

    def team_reward(self) -> float:
        return float(self.guess == self.relay.secret)


async def run_tool(call: ToolCall, *, timeout_s: float) -> str:
    """Execute one tool call on the running event loop; returns its output text."""
    if call.kind == "wait":
        await asyncio.sleep(call.seconds)
        return call.expected
    if call.kind != "python":
        raise ValueError(f"unknown tool kind {call.kind!r}; known: {TOOL_KINDS}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        "-c",
        call.code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    return out.decode().strip()


@ORCHESTRAS.register("tool_calls")
class ToolCalls(Orchestra):
    """Turn-taking over the env's active agents; after each turn, execute the tool call the action left."""

    @dataclass
    class Config(OrchestraConfig):
        max_steps: int = 64  # agent turns per episode
        tool_timeout_s: float = 30.0

        def __post_init__(self) -> None:
            if self.max_steps < 1:
                raise ValueError(f"orchestra.max_steps must be >= 1, got {self.max_steps}")
            if not self.tool_timeout_s > 0:
                raise ValueError(f"orchestra.tool_timeout_s must be > 0, got {self.tool_timeout_s}")

    config: Config  # the registry builds each orchestra with its own Config

    async def run(self, ctx: EpisodeContext) -> None:
        if not isinstance(ctx.env, ToolEnv):
            raise ConfigError(f"orchestra 'tool_calls' needs a ToolEnv, got {type(ctx.env).__name__}")
        for _ in range(self.config.max_steps):
            active = ctx.env.active_agents()
            if not active:
                return
            await ctx.turn(active[0])
            call = ctx.env.pending_call()
            if call is not None:
                ctx.env.finish_call(await run_tool(call, timeout_s=self.config.tool_timeout_s))


@dataclass(frozen=True)
class JudgedSecret:
    secret: int
    judge_s: float  # how long each step's judge blocks


@dataclass
class SlowJudgeConfig(SignallingConfig):
    judge_s: list[float] = field(default_factory=lambda: [0.2])  # judge seconds per step, drawn per task

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.judge_s or min(self.judge_s) < 0:
            raise ValueError(f"env.judge_s must be a non-empty list of seconds >= 0, got {self.judge_s}")


@ENVS.register("slow_judge")
class SlowJudgeEnv(SignallingEnv[SlowJudgeConfig]):
    """Signalling (sender, receiver) with a blocking judge on every step (module docstring)."""

    Config = SlowJudgeConfig
    remote_step = True

    def __init__(self, task: Task, config: SlowJudgeConfig) -> None:
        super().__init__(task, config)
        self.secret, self.judge_s = task.payload.secret, task.payload.judge_s

    @classmethod
    def generate_tasks(cls, config: SlowJudgeConfig, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed ^ 0x5EED)  # not the secrets' stream: the same secrets as signalling
        return [
            Task(
                t.task_id.replace("signal-", "judged-", 1),
                JudgedSecret(t.payload, rng.choice(config.judge_s)),
            )
            for t in super().generate_tasks(config, num_tasks=num_tasks, seed=seed)
        ]

    def step(self, agent: str, action) -> StepResult:
        time.sleep(self.judge_s)  # blocks its caller: the event loop, or an env worker
        return super().step(agent, action)
