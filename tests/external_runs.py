"""Episodes of the ``external`` orchestra against the scripted engine, for the endpoint's integration
tests (test_openai_endpoint, test_endpoint_abuse): one setup (a tokenizer, the math env's tasks, a
``solver`` agent, an engine that answers "4") instead of one copy per module."""

from __future__ import annotations

import asyncio
import sys
import time

from scripted import ScriptedEngine, fixed, smollm2_tokenizer

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.episodes import RolloutResult


def run_program(
    program: str | list[str],
    *,
    num_tasks: int = 1,
    agents: dict[str, AgentConfig] | None = None,
    engine=None,
    episode_timeout_s: float | None = None,
    episodes_at_once: int = 64,
    **orchestra_kwargs,
) -> RolloutResult:
    """``num_tasks`` episodes of ``program`` (Python source run with ``-c``, or an argv) under the
    ``external`` orchestra, roles ``solver`` unless ``roles`` is given, ``timeout_s`` 60 unless given."""
    tokenizer = smollm2_tokenizer()
    maker = EnvMaker("math")
    agents = agents or {"solver": AgentConfig(policy="default")}
    command = [sys.executable, "-c", program] if isinstance(program, str) else program
    orchestra_kwargs = {"roles": list(agents), "timeout_s": 60, **orchestra_kwargs}
    orchestra = build_orchestra("external", command=command, **orchestra_kwargs)
    return asyncio.run(
        run_episodes(
            orchestra,
            maker,
            maker.tasks(num_tasks, seed=0),
            agents=build_agents(agents, tokenizer, default_kinds=maker.default_agents),
            engines={"default": engine or ScriptedEngine(tokenizer, fixed("4"))},
            episode_timeout_s=episode_timeout_s,
            max_concurrency=episodes_at_once,  # run_episodes' own limit (each episode's timeout within)
        )
    )


def run_one_episode(program: str | list[str], **kwargs):
    """The one episode of ``run_program(program, num_tasks=1, ...)``."""
    [episode] = run_program(program, **kwargs).episodes
    return episode


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a reaped or exited program's pid is not alive)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def survivors(pids: list[int], *, within_s: float = 5.0) -> list[int]:
    """The ``pids`` still alive after waiting up to ``within_s`` for all of them to end."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]
