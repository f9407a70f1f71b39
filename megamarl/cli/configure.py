"""``load_config``: the run config composed (``megamarl.config``) and checked against every registry.

``megamarl.config`` is the ground of the package: it composes the YAML and Hydra overrides and runs
the checks a section can make alone. Whatever needs more -- a registered engine, estimator, env,
orchestra, agent kind, schedule or worker backend, the hardware's dtypes, a packaged model, the
engine ranks, the user's plugins -- is checked here, right after composition and before anything is
built, by the function of the module that owns it (``check_workers`` in orchestration/workers.py,
``check_trainer`` in driver/schedules.py, ...). Every entry point (scripts/train.py, evaluate.py,
export, the dry run, the Slurm job helper, the tests) loads a config through this one function, so a
typo stops the run at load time with the full key named, whichever door it came in by.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import megamarl.orchestration  # noqa: F401 - registers the built-in agents, envs, orchestras
from megamarl.config import RunConfig, compose_run_config, path_exists
from megamarl.config_sections import EnvSpec, OrchestraSpec
from megamarl.driver.opponent_pool import OPPONENT_PICKS
from megamarl.driver.schedules import check_trainer
from megamarl.models.packaged import PACKAGED_MODELS, TINY_MODELS
from megamarl.orchestration.agents import AGENTS
from megamarl.orchestration.env import ENVS
from megamarl.orchestration.orchestras import ORCHESTRAS, check_team, default_kinds
from megamarl.orchestration.tools import TOOLS
from megamarl.orchestration.workers import check_workers
from megamarl.parallel.hardware import check_dtypes
from megamarl.parallel.placement import check_placement_mode
from megamarl.planning.expert_plan import check_expert_parallel
from megamarl.planning.model_presets import PRESETS, declared_moe
from megamarl.registry import Registry, import_plugins
from megamarl.rl.advantages import check_algorithm, check_estimator, check_policy_algorithm
from megamarl.rl.rewards import check_team_alpha_schedule
from megamarl.rollout import ENGINES
from megamarl.rollout.engine_placement import check_engine_ranks, check_launch
from megamarl.rollout.servers.server_launch import check_server_python

# A Hugging Face hub id ("org/name") that is not a local directory: megamarl never downloads.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML (composed with Hydra) + overrides -> a ``RunConfig`` that passed every load-time check.
    Errors are ValueErrors that name the offending key (YAML syntax: file, line, column); a plugin
    that does not import raises its ImportError."""
    cfg = compose_run_config(path, overrides)
    check_config(cfg)
    return cfg


def check_config(cfg: RunConfig) -> None:
    """The checks that need registries, the placement or plugins, in the order a reader fixes them:
    placement and policies, rollout and trainer sections, then (plugins imported) names and kwargs."""
    check_placement_mode(cfg)
    configurable = [n for n in ENGINES.names() if ENGINES.traits(n).configurable]
    for name, policy in cfg.policies.items():
        with _named("policies.<p>", f"policies.{name}"):
            _check_model(policy.model)
            _check_experts(cfg, name)
            if policy.engine.backend not in configurable:
                raise ValueError(
                    f"policies.<p>.engine.backend='{policy.engine.backend}' unknown; allowed: {configurable}"
                )
            check_launch(policy.engine)
            if policy.engine.server_python is not None:
                check_server_python(policy.engine.server_python, policy.engine.backend)
    check_dtypes(cfg)
    check_engine_ranks(cfg.policies)
    check_workers(cfg.rollout.env_workers)
    OPPONENT_PICKS.get(cfg.rollout.opponent_pool.pick, key="rollout.opponent_pool.pick")
    check_team_alpha_schedule(cfg.algorithm.team_alpha_schedule)
    check_trainer(cfg.trainer)
    import_plugins(cfg.plugins, paths=cfg.plugin_paths)  # they may register estimators, envs, agents...
    check_algorithm(cfg.algorithm)
    _check_team(cfg)
    _check_policy_algorithms(cfg)
    if cfg.rollout.policy_mapping:
        cfg.check_policy_mapping()


@contextmanager
def _named(placeholder: str, name: str) -> Iterator[None]:
    """A section's check words its keys with a placeholder (``policies.<p>.engine.tp``): put the
    entry's name in."""
    try:
        yield
    except ValueError as exc:
        if placeholder not in str(exc):
            raise
        raise ValueError(str(exc).replace(placeholder, name)) from exc


def _check_model(model: str) -> None:
    """``policies.<p>.model``: a packaged model, a --dry-run architecture preset or a local directory."""
    known = model in PACKAGED_MODELS or model in TINY_MODELS or model in PRESETS
    if not known and not path_exists(Path(model).expanduser()):
        hub = " looks like a model hub id (megamarl never downloads);" if _HUB_ID.fullmatch(model) else ""
        raise ValueError(
            f"policies.<p>.model='{model}'{hub} is not a local directory, a packaged model "
            f"{sorted(PACKAGED_MODELS) + sorted(TINY_MODELS)} or a --dry-run architecture preset "
            f"{sorted(PRESETS)}; scripts/prepare_model.py writes a local directory"
        )


def _check_experts(cfg: RunConfig, name: str) -> None:
    """``policies.<p>.ep`` and ``policies.<p>.moe`` against the model's experts
    (``planning.expert_plan``), on the WG's ranks when the config fixes them (its ``ranks``, or every
    rank of a declared GPU cluster)."""
    policy = cfg.policies[name]
    try:
        moe = declared_moe(policy.model)
    except ValueError as exc:  # an MoE config.json the planner cannot price
        raise ValueError(f"policies.<p>.model='{policy.model}': {exc}") from exc
    cluster = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    num_ranks = len(policy.ranks) if policy.ranks else (cluster or None)
    check_expert_parallel(policy, moe, num_ranks=num_ranks)


def _check_team(cfg: RunConfig) -> None:
    """Env, orchestra and every eval env are registered and take their kwargs; agent kinds are
    registered; the orchestra's and env's roles are covered by ``agents`` (``check_team``)."""
    eval_envs = {
        f"eval.sets.{name}" if name else "eval.env": env
        for name, env in cfg.eval.resolved_sets(cfg.env).items()
    }
    sections: list[tuple[str, Registry[Any], EnvSpec | OrchestraSpec]]
    sections = [("env", ENVS, cfg.env), ("orchestra", ORCHESTRAS, cfg.orchestra)]
    sections += [(key, ENVS, env) for key, env in eval_envs.items()]
    built = {}
    for key, registry, section in sections:
        cls = registry.get(section.name, key=f"{key}.name")
        try:
            built[key] = (cls, cls.Config(**section.kwargs))
        except TypeError as exc:  # an unknown keyword
            raise ValueError(f"{key}.kwargs for {key} '{section.name}': {exc}") from exc
        except ValueError as exc:  # the env's own validation (names its field, not where it came from)
            if key == "env":
                raise
            raise ValueError(f"{key}.kwargs: {exc}") from exc
    for role, agent in cfg.agents.items():
        if agent.kind:
            AGENTS.get(agent.kind, key=f"agents.{role}.kind")
        for tool in agent.tools:
            TOOLS.get(tool, key=f"agents.{role}.tools")
    orchestra_cls, orchestra_config = built.pop("orchestra")
    orchestra = orchestra_cls(orchestra_config)
    kinds = {role: agent.kind for role, agent in cfg.agents.items()}
    for key, (env_cls, env_config) in built.items():  # the training env and every eval env
        env_name = cfg.env.name if key == "env" else eval_envs[key].name
        bound_s = env_cls.max_step_s(env_config)
        if bound_s is not None and not bound_s < cfg.rollout.env_timeout_s:
            raise ValueError(
                f"{key}.kwargs of env '{env_name}': one step may take up to {bound_s:g} s (its time "
                f"budget), not below rollout.env_timeout_s={cfg.rollout.env_timeout_s:g}, so a slow "
                "step would fail its episode instead of scoring 0; lower the env's budget (code: "
                "problem_budget_s) or raise rollout.env_timeout_s"
            )
        check_team(
            orchestra,
            orchestra_name=cfg.orchestra.name,
            env_name=env_name,
            env_roles=tuple(env_cls.agents),
            acting=env_cls.acting_roles(env_config),
            agent_kinds=kinds,
            default_kinds=default_kinds(orchestra, tuple(env_cls.agents), env_cls.default_agents),
            key=key,
        )


def _check_policy_algorithms(cfg: RunConfig) -> None:
    """``policies.<p>.algorithm``: registered names, valid merged settings, no dynamic sampling."""
    for name, policy in cfg.policies.items():
        key = f"policies.{name}.algorithm"
        check_policy_algorithm(policy.algorithm, key=key)
        overrides = policy.algorithm.advantage_overrides()  # mismatch is the loss's alone
        if not overrides:
            continue
        if cfg.algorithm.dynamic_sampling:
            raise ValueError(
                f"{key} sets {sorted(overrides)}, but algorithm.dynamic_sampling filters groups with "
                "one estimator over the whole batch; per-policy estimators need dynamic_sampling: false"
            )
        try:
            check_estimator(cfg.policy_algorithm(name))
        except ValueError as exc:  # the check names algorithm.<k>: the key the policy set
            raise ValueError(str(exc).replace("algorithm.", f"{key}.")) from exc
