"""Orchestration: agents, orchestras (who acts when), environments, tree sampling, rollout driver.

Importing this package registers every built-in agent kind, orchestra, env and env-worker
backend. Public entry points:

* ``AGENTS``/``AgentConfig``/``SamplingConfig``/``build_agents``  (agents.py; the ``agents.<role>`` config
  section)
* ``ORCHESTRAS``/``build_orchestra``            (orchestras.py; ``external``: external.py, openai_endpoint.py)
* ``ENVS``/``EnvMaker``/``Env``/``Task``        (env.py, envs/)
* ``EpisodeContext``/``Action``                 (context.py)
* ``run_episodes``/``RolloutResult``            (episodes.py)
* ``make_workers``/``WorkersConfig``            (workers.py)
"""

from megamarl.orchestration import envs, external  # noqa: F401 - registration
from megamarl.orchestration.agents import AGENTS, Agent, AgentConfig, SamplingConfig, build_agents
from megamarl.orchestration.context import Action, ConfigError, EpisodeContext, EpisodeDone, EpisodeDropped
from megamarl.orchestration.env import ENVS, Env, EnvConfig, EnvMaker, StepResult, Task
from megamarl.orchestration.envs import openenv, pettingzoo, textarena  # noqa: F401 - registration (after external)
from megamarl.orchestration.episodes import EpisodeStats, RolloutResult, run_episode, run_episodes
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, build_orchestra
from megamarl.orchestration.workers import WORKERS, EnvWorkerError, EnvWorkers, WorkersConfig, make_workers

__all__ = [
    "AGENTS",
    "ENVS",
    "ORCHESTRAS",
    "WORKERS",
    "Action",
    "Agent",
    "AgentConfig",
    "ConfigError",
    "Env",
    "EnvConfig",
    "EnvMaker",
    "EnvWorkerError",
    "EnvWorkers",
    "EpisodeContext",
    "EpisodeDone",
    "EpisodeDropped",
    "EpisodeStats",
    "Orchestra",
    "RolloutResult",
    "SamplingConfig",
    "StepResult",
    "Task",
    "WorkersConfig",
    "build_agents",
    "build_orchestra",
    "make_workers",
    "run_episode",
    "run_episodes",
]
