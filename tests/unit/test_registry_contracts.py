"""Every extension point is one ``Registry`` with a documented signature; every registered entry
honours it (docs/style.md "Extension points are typed and tested", "Traits live on the registry
entry"). A new plugin inherits these checks by registering."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch
from scripted import smollm2_tokenizer  # tests/ helper

import megamarl.orchestration  # noqa: F401 - registers the built-in agents, envs, orchestras
from megamarl.driver.opponent_pool import OPPONENT_PICKS
from megamarl.driver.schedules import SCHEDULES, Schedule, ScheduleTraits
from megamarl.models.families import MODEL_FAMILIES
from megamarl.orchestration.agents import AGENTS, Agent, AgentConfig
from megamarl.orchestration.env import ENVS, Env, EnvConfig, EnvMaker, Task
from megamarl.orchestration.orchestras import ORCHESTRAS, Orchestra, OrchestraConfig
from megamarl.orchestration.tools import TOOLS
from megamarl.orchestration.workers import WORKERS, EnvWorkers
from megamarl.registry import Registry
from megamarl.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    EstimatorTraits,
    GroupIndex,
    compute_advantages,
)
from megamarl.rl.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
from megamarl.rl.rewards import ALPHA_SCHEDULES
from megamarl.rollout import ENGINES, Engine
from megamarl.rollout.engines.base import EngineTraits

REGISTRIES = [
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    ENGINES,
    SCHEDULES,
    AGENTS,
    ENVS,
    ORCHESTRAS,
    WORKERS,
    MODEL_FAMILIES,
    ALPHA_SCHEDULES,
    OPPONENT_PICKS,
    TOOLS,
]
# envs whose Config has required fields: the kwargs a run would give
ENV_KWARGS = {
    "pettingzoo_parallel": {"factory": "megamarl.orchestration.envs.pettingzoo_games:make_echo_parallel"},
    "pettingzoo_aec": {"factory": "megamarl.orchestration.envs.pettingzoo_games:make_counting_aec"},
    "textarena": {"game": "TicTacToe-v0"},
    "openenv": {"environment": "megamarl.orchestration.envs.openenv_relay:RelayEnvironment"},
}
ENV_PACKAGES = {
    "reasoning_gym": "reasoning_gym",
    "textarena": "textarena",
    "openenv": "openenv",
}  # envs of an optional extra: skipped without it


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_registry_documents_its_signature_and_has_entries(registry):
    assert isinstance(registry, Registry) and registry.signature and registry.names()
    for name in registry.names():
        traits = registry.traits(name)
        assert (traits is None) == (registry.traits_type is None), name
        if registry.traits_type is not None:
            assert isinstance(traits, registry.traits_type), name


def test_every_registry_megamarl_declares_is_checked_here():
    import megamarl.cli.configure  # noqa: F401 - imports every module that declares a registry

    declared = {id(r): r.kind for r in Registry.instances if r.module.startswith("megamarl.")}
    assert declared == {id(r): r.kind for r in REGISTRIES}


def test_registry_rejects_duplicates_wrong_traits_and_names_the_key():
    reg = Registry("thing", traits=EngineTraits, signature="fn()")
    reg.add("a", len)
    assert reg.traits("a") == EngineTraits()  # no traits given: the conservative defaults
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", print)
    with pytest.raises(TypeError, match="traits must be EngineTraits"):
        reg.add("b", print, traits=EstimatorTraits())
    with pytest.raises(ValueError, match=r"unknown thing x.y='c'; registered: \['a'\]"):
        reg.get("c", key="x.y")


# ---- advantage estimators: the signature, and the traits are true ----------------------------------


def _index():
    # 2 tasks x 2 episodes x 2 agents x 1 turn; the two agents act on different policies
    n = 8
    task = [0, 0, 0, 0, 1, 1, 1, 1]
    episode = [0, 0, 1, 1, 2, 2, 3, 3]
    agent = [0, 1] * 4
    return GroupIndex(
        task=task,
        episode=episode,
        agent=agent,
        policy=agent,
        turn=[0] * n,
        step=[0] * n,
        anchors=["a", "b"] * 4,
    )


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_estimator_signature_and_output_shape(name):
    fn = ADVANTAGE_ESTIMATORS.get(name)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:3]] == ["rewards", "index", "cfg"], name
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    mask = torch.ones(8, 3, dtype=torch.bool)
    out = compute_advantages(
        rewards,
        _index(),
        AdvantageConfig(estimator=name, group_by=["task", "agent"]),
        response_mask=mask,
        values=torch.zeros(8, 3),
    )
    if ADVANTAGE_ESTIMATORS.traits(name).needs_critic:
        adv, returns = out  # token-level, with the critic's targets
        assert adv.shape == returns.shape == (8, 3) and torch.isfinite(adv).all()
    else:
        assert out.shape == (8,) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "name", [n for n in ADVANTAGE_ESTIMATORS.names() if not ADVANTAGE_ESTIMATORS.traits(n).needs_critic]
)
def test_estimator_traits_tell_the_truth_about_grouping(name):
    """Changing the rewards of one policy's samples leaves the other policy's advantages unchanged
    exactly when the traits say the estimator is policy-separable under its group key."""
    traits = ADVANTAGE_ESTIMATORS.traits(name)
    cfg = AdvantageConfig(estimator=name, group_by=["task", "agent"])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    other = rewards.clone()
    other[1::2] = torch.tensor([5.0, -2.0, 0.25, 3.0])  # policy 1's samples only
    mask = torch.ones(8, 3, dtype=torch.bool)
    a = compute_advantages(rewards, _index(), cfg, response_mask=mask)
    b = compute_advantages(other, _index(), cfg, response_mask=mask)
    assert torch.equal(a[0::2], b[0::2]) == traits.policy_separable(cfg.group_by), name


# ---- the other function registries -----------------------------------------------------------------


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_is_elementwise_and_zero_at_the_reference(name):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    kl = KL_ESTIMATORS.get(name)(logp, logp.clone())
    assert kl.shape == logp.shape and torch.equal(kl, torch.zeros_like(kl))
    assert KL_ESTIMATORS.get(name)(logp, logp - 1).shape == logp.shape


@pytest.mark.parametrize("name", LOSS_AGGREGATIONS.names())
def test_loss_aggregation_is_a_scalar_of_masked_tokens(name):
    fn = LOSS_AGGREGATIONS.get(name)
    assert {"num_tokens", "num_seqs"} <= {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY
    }
    loss = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = fn(loss, mask, num_tokens=3, num_seqs=2)
    assert out.dim() == 0 and float(out) < 99  # masked positions never enter


# ---- class registries ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENGINES.names())
def test_engine_classes_implement_what_their_traits_declare(name):
    cls, traits = ENGINES.get(name), ENGINES.traits(name)
    assert issubclass(cls, Engine)
    assert (cls.from_config.__func__ is not Engine.from_config.__func__) == traits.configurable, name
    assert (cls.sleep is not Engine.sleep) == traits.can_sleep, name
    if traits.serves_lora:
        assert callable(getattr(cls, "add_lora", None)), name


def test_configurable_hf_engine_builds_from_config_and_replicas_pool(tmp_path):
    from megamarl.config import EngineConfig
    from megamarl.models.packaged import resolve_model_path
    from megamarl.rollout import EnginePool
    from megamarl.rollout.replicas.factory import build_engine

    path = resolve_model_path("tiny-plain-llama", key="test")
    assert type(build_engine(EngineConfig(backend="hf"), path)).__name__ == "HFEngine"
    pool = build_engine(EngineConfig(backend="hf", num_replicas=2), path)
    assert isinstance(pool, EnginePool) and len(pool.replicas) == 2
    pool.shutdown()


@pytest.mark.parametrize("name", SCHEDULES.names())
def test_schedule_classes(name):
    cls, traits = SCHEDULES.get(name), SCHEDULES.traits(name)
    assert issubclass(cls, Schedule) and isinstance(traits, ScheduleTraits)
    assert list(inspect.signature(cls).parameters) == ["cfg", "source", "loop"]
    assert traits.min_staleness <= 1 and traits.overlaps_training == (traits.min_staleness > 0)


@pytest.mark.parametrize("name", AGENTS.names())
def test_agent_kinds_build_from_agent_config_and_parse(name):
    cls = AGENTS.get(name)
    assert issubclass(cls, Agent)
    agent = cls("role", AgentConfig(policy="default", kind=name, choices=("a", "b")), smollm2_tokenizer())
    _action, valid = agent.parse("a")
    assert isinstance(valid, bool)


@pytest.mark.parametrize("name", ENVS.names())
def test_envs_have_a_validated_config_generate_tasks_and_observe(name):
    cls = ENVS.get(name)
    assert issubclass(cls, Env) and issubclass(cls.Config, EnvConfig)
    if name in ENV_PACKAGES:
        pytest.importorskip(ENV_PACKAGES[name])
    maker = EnvMaker(name, **ENV_KWARGS.get(name, {}))
    tasks = maker.tasks(2, seed=0)
    assert len(tasks) == 2 and all(isinstance(t, Task) for t in tasks)
    assert maker.tasks(2, seed=0) == tasks  # seeded
    env = maker(tasks[0])
    assert env.agents and isinstance(env.observe(env.agents[0]), str)


@pytest.mark.parametrize("name", ORCHESTRAS.names())
def test_orchestras_have_a_config_and_an_async_run(name):
    cls = ORCHESTRAS.get(name)
    assert issubclass(cls, Orchestra) and issubclass(cls.Config, OrchestraConfig)
    assert asyncio.iscoroutinefunction(cls.run)


@pytest.mark.parametrize("name", WORKERS.names())
def test_env_worker_backends(name):
    cls = WORKERS.get(name)
    assert issubclass(cls, EnvWorkers) and asyncio.iscoroutinefunction(cls._run)
    WORKERS.traits(name)  # what a backend needs (a package, an address) is declared where it registers


@pytest.mark.parametrize("name", MODEL_FAMILIES.names())
def test_model_families(name):
    module = MODEL_FAMILIES.get(name)
    assert name in module.MODEL_TYPES and callable(module.arch_from_hf)


@pytest.mark.parametrize("name", ALPHA_SCHEDULES.names())
def test_team_alpha_schedule_shapes_run_from_0_to_1(name):
    shape = ALPHA_SCHEDULES.get(name)
    assert shape(0.0) == 0.0 and shape(1.0) == (0.0 if name == "constant" else 1.0)
    assert all(0.0 <= shape(p / 10) <= 1.0 for p in range(11))
