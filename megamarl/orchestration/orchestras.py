"""Orchestras: who acts when, as plain async code over an ``EpisodeContext``.

Each orchestra is a class registered in ``ORCHESTRAS`` with its own validated ``Config``; its
``run(ctx)`` is ordinary async Python, not a graph DSL. Built-ins: ``sequential`` (turn order, inactive
agents skipped, up to ``max_steps``), ``router`` (the router's reply names the next agent, up to
``max_hops``), ``solve_verify`` (solver then verifier, up to ``max_loops``, early stop on done or
``approve_value``), ``dag`` (``nodes`` run level by level, a level concurrently, its env steps applied
in sorted agent order so transitions stay deterministic) and ``simultaneous`` (every active agent
acts at once, then all step: parallel-API games).
Details: docs/design-notes.md, "megamarl/orchestration/orchestras.py".
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megamarl.orchestration.context import Action, EpisodeContext
from megamarl.registry import Registry


@dataclass
class OrchestraConfig:
    pass


class Orchestra(abc.ABC):
    Config: ClassVar[type[OrchestraConfig]] = OrchestraConfig

    # the agent kind of every role it calls whose agents.<role>.kind is unset, over the env's default
    # kinds ("": the env's): an orchestra whose replies are someone else's (the external program's)
    # must not run the env's parsers on them
    agent_kind: ClassVar[str] = ""

    def __init__(self, config: OrchestraConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        """The roles this orchestra calls in an env whose roles are ``env_roles`` (load-time check:
        each needs an ``agents.<role>`` entry; ``check_team``). Default: the env's roles."""
        return env_roles

    def counters(self) -> dict[str, float]:
        """Running totals the driver logs each step as ``orchestra/<key>`` (the external orchestra's
        ``program_starts``); none by default."""
        return {}

    @abc.abstractmethod
    async def run(self, ctx: EpisodeContext) -> None:
        """Drive one episode until it is done or out of budget."""


def default_kinds(
    orchestra: Orchestra, env_roles: tuple[str, ...], env_kinds: Mapping[str, str]
) -> dict[str, str]:
    """Role -> the agent kind a role without ``agents.<role>.kind`` gets: the env's default, or the
    orchestra's ``agent_kind`` for every role it calls (one answer for load time and the run)."""
    if not orchestra.agent_kind:
        return dict(env_kinds)
    return {**env_kinds, **dict.fromkeys(orchestra.roles(env_roles), orchestra.agent_kind)}


ORCHESTRAS: Registry[type[Orchestra]] = Registry(
    "orchestra",
    signature="class(Orchestra) with a Config(OrchestraConfig); cls(config); async run(ctx: EpisodeContext)",
    keys=("orchestra.name",),
)


def check_team(
    orchestra: Orchestra,
    *,
    orchestra_name: str,
    env_name: str,
    env_roles: tuple[str, ...],
    acting: tuple[str, ...],
    agent_kinds: dict[str, str],
    default_kinds: dict[str, str],
    key: str = "env",
) -> None:
    """Load time, before any model exists: the roles ``orchestra`` calls in env ``env_name`` (those
    the env turns off by config excluded) each have an ``agents.<role>`` entry, and each
    ``agents.<role>`` either plays a role of the env or the orchestra or names its ``kind``.
    ``agent_kinds``: role -> ``agents.<role>.kind`` ('' when unset). Without the check a missing role
    is a KeyError at the first episode, after the models loaded. Envs whose roles are known only per
    episode (``env_roles`` empty: PettingZoo games) are not checked."""
    if not env_roles:
        return
    called = orchestra.roles(env_roles)
    known = set(env_roles) | set(called)
    for role, kind in agent_kinds.items():  # a typo first: it is also why a needed role looks missing
        if not kind and role not in known:
            raise ValueError(
                f"agents.{role}: '{role}' is not a role of {key} '{env_name}' (its roles: "
                f"{list(env_roles)}) nor one orchestra '{orchestra_name}' calls; rename the entry, "
                f"or set agents.{role}.kind for an extra agent"
            )
        if not kind and role not in default_kinds:
            raise ValueError(
                f"agents.{role}.kind is empty and {key} '{env_name}' has no default kind for role "
                f"'{role}' (defaults: {default_kinds})"
            )
    needed = [r for r in dict.fromkeys(called) if r not in env_roles or r in acting]
    missing = [r for r in needed if r not in agent_kinds]
    if missing:
        raise ValueError(
            f"agents.{missing[0]} is not defined, but orchestra '{orchestra_name}' calls role "
            f"'{missing[0]}' in {key} '{env_name}' (roles called: {needed}, from orchestra.kwargs or "
            f"the env's roles {list(env_roles)}); define agents.{missing[0]} or fix the role name "
            f"(agents defined: {sorted(agent_kinds)})"
        )


def build_orchestra(name: str, **config: Any) -> Orchestra:
    cls = ORCHESTRAS.get(name, key="orchestra.name")
    return cls(cls.Config(**config))


def _positive(value: int, key: str) -> None:
    if value < 1:
        raise ValueError(f"orchestra.{key} must be >= 1, got {value}")


@ORCHESTRAS.register("sequential")
class Sequential(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
        order: tuple[str, ...] = ()  # empty: the env's agents
        max_steps: int = 16  # agent calls per episode, then it ends

        def __post_init__(self) -> None:
            self.order = tuple(self.order)
            _positive(self.max_steps, "max_steps")

    config: Config  # the registry builds each orchestra with its own Config

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return self.config.order or env_roles

    async def run(self, ctx: EpisodeContext) -> None:
        order = self.config.order or tuple(ctx.env.agents)
        num_steps = 0
        while not ctx.done and num_steps < self.config.max_steps:
            acted = False
            for agent in order:
                if ctx.done or num_steps >= self.config.max_steps:
                    return
                if agent not in ctx.env.active_agents():
                    continue
                await ctx.turn(agent)
                num_steps += 1
                acted = True
            if not acted:  # nobody in ``order`` may act: the FSM is stuck, end the episode
                return


@ORCHESTRAS.register("router")
class Router(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
        router: str = "router"  # the role whose reply names the next agent
        max_hops: int = 6  # router decisions per episode

        def __post_init__(self) -> None:
            _positive(self.max_hops, "max_hops")

    config: Config  # the registry builds each orchestra with its own Config

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return (self.config.router,)  # the router's picks are checked per episode (an unknown pick ends it)

    async def run(self, ctx: EpisodeContext) -> None:
        for _ in range(self.config.max_hops):
            if ctx.done:
                return
            decision = await ctx.turn(self.config.router)
            if not decision.valid or decision.value not in ctx.agents or ctx.done:
                return  # an unusable routing decision ends the episode (sample is marked invalid)
            await ctx.turn(decision.value)


@ORCHESTRAS.register("solve_verify")
class SolveVerify(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
        solver: str = "solver"  # the solving role
        verifier: str = "verifier"  # the verifying role
        max_loops: int = 3  # solver + verifier rounds per episode
        approve_value: Any = None  # None: only the env's done ends the loop early

        def __post_init__(self) -> None:
            _positive(self.max_loops, "max_loops")

    config: Config  # the registry builds each orchestra with its own Config

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return (self.config.solver, self.config.verifier)

    async def run(self, ctx: EpisodeContext) -> None:
        for _ in range(self.config.max_loops):
            if ctx.done:
                return
            await ctx.turn(self.config.solver)
            if ctx.done:
                return
            verdict = await ctx.turn(self.config.verifier)
            approve = self.config.approve_value
            if approve is not None and verdict.valid and verdict.value == approve:
                return


def topological_levels(nodes: dict[str, tuple[str, ...]]) -> list[list[str]]:
    """Kahn's algorithm by levels; raises ValueError naming ``orchestra.nodes`` on cycles/unknown inputs."""
    for node, deps in nodes.items():
        unknown = [d for d in deps if d not in nodes]
        if unknown:
            raise ValueError(f"orchestra.nodes.{node} reads unknown nodes {unknown}; nodes: {sorted(nodes)}")
    remaining = {node: set(deps) for node, deps in nodes.items()}
    levels: list[list[str]] = []
    while remaining:
        ready = sorted(node for node, deps in remaining.items() if not deps)
        if not ready:
            raise ValueError(f"orchestra.nodes has a cycle among {sorted(remaining)}")
        levels.append(ready)
        for node in ready:
            del remaining[node]
        for pending in remaining.values():
            pending.difference_update(ready)
    return levels


@ORCHESTRAS.register("dag")
class Dag(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
        # agent -> the agents whose replies it reads
        nodes: dict[str, tuple[str, ...]] = field(default_factory=dict)
        rounds: int = 1  # passes over the whole DAG

        def __post_init__(self) -> None:
            if not self.nodes:
                raise ValueError("orchestra.nodes must map each agent to the agents it reads")
            self.nodes = {node: tuple(deps) for node, deps in self.nodes.items()}
            _positive(self.rounds, "rounds")
            self.levels = topological_levels(self.nodes)

    config: Config  # the registry builds each orchestra with its own Config

    def roles(self, env_roles: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self.config.nodes)

    async def _node(self, ctx: EpisodeContext, agent: str, outputs: dict[str, Action]) -> Action:
        inputs = "".join(f"\n[{dep}] {outputs[dep].text.strip()}" for dep in self.config.nodes[agent])
        observation = ctx.env.observe(agent)
        return await ctx.act(agent, f"{observation}\n\nInputs:{inputs}" if inputs else observation)

    async def run(self, ctx: EpisodeContext) -> None:
        for _ in range(self.config.rounds):
            outputs: dict[str, Action] = {}
            for level in self.config.levels:
                level = [a for a in level if a in ctx.env.active_agents()]
                if ctx.done or not level:
                    return
                actions = await asyncio.gather(*(self._node(ctx, agent, outputs) for agent in level))
                for agent, action in zip(level, actions, strict=True):
                    outputs[agent] = action
                    if not ctx.done:
                        await ctx.step(agent, action)


@ORCHESTRAS.register("simultaneous")
class Simultaneous(Orchestra):
    @dataclass
    class Config(OrchestraConfig):
        max_rounds: int = 8  # rounds in which every active agent acts

        def __post_init__(self) -> None:
            _positive(self.max_rounds, "max_rounds")

    config: Config  # the registry builds each orchestra with its own Config

    async def run(self, ctx: EpisodeContext) -> None:
        for _ in range(self.config.max_rounds):
            active = ctx.env.active_agents()
            if ctx.done or not active:
                return
            observations = {agent: ctx.env.observe(agent) for agent in active}
            actions = await asyncio.gather(*(ctx.act(agent, observations[agent]) for agent in active))
            for agent, action in zip(active, actions, strict=True):
                await ctx.step(agent, action)
