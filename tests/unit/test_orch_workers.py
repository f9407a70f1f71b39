"""Env workers: a crashing, hanging or raising env fails only its episode (counted); the run goes on."""

import asyncio

import pytest

from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    Task,
    WorkersConfig,
    build_agents,
    build_orchestra,
    make_workers,
    run_episodes,
)
from megamarl.orchestration.testing import ScriptedEngine, fixed, smollm2_tokenizer


def _rollout(workers, faults, **kwargs):
    tok = smollm2_tokenizer()
    maker = EnvMaker("testing_faulty")
    agents = build_agents({"actor": AgentConfig(policy="default")}, tok, default_kinds=maker.default_agents)
    tasks = [Task(f"t{i}-{fault}", fault) for i, fault in enumerate(faults)]
    return asyncio.run(run_episodes(build_orchestra("sequential", max_steps=2), maker, tasks, agents=agents,
                                    engines={"default": ScriptedEngine(tok, fixed("ok"))}, workers=workers, **kwargs))


def test_config_validation():
    with pytest.raises(ValueError, match="env_workers.num_workers"):
        WorkersConfig(num_workers=0)
    with pytest.raises(ValueError, match="env_workers.kind"):
        make_workers(kind="threads")


def test_inline_worker_error_fails_only_that_episode():
    result = _rollout(make_workers(kind="inline"), ["none", "raise", "none"])
    assert [e.status for e in result.episodes] == ["ok", "failed", "ok"]
    assert result.reasons() == {"env_worker:error": 1}
    assert [s.task_id for s in result.samples] == ["t0-none", "t2-none"]
    assert all(s.local_reward == 0.5 and s.team_reward == 1.0 for s in result.samples)


def test_process_pool_crash_hang_and_error_are_counted():
    workers = make_workers(kind="process", num_workers=2, timeout_s=1.5)
    try:
        result = _rollout(workers, ["none", "crash", "hang", "raise", "none", "none"], step_timeout_s=1.5)
        assert [e.status for e in result.episodes] == ["ok", "failed", "failed", "failed", "ok", "ok"]
        assert result.reasons() == {"env_worker:crash": 1, "env_worker:timeout": 1, "env_worker:error": 1}
        assert result.num_failed == 3 and len(result.samples) == 3
        assert workers.num_failures == {"crash": 1, "timeout": 1, "error": 1}
        again = _rollout(workers, ["none", "none"])  # replaced slots work, on a new event loop too
        assert [e.status for e in again.episodes] == ["ok", "ok"]
    finally:
        workers.close()


def test_episode_timeout_without_workers():
    tok = smollm2_tokenizer()
    maker = EnvMaker("math", kinds=("add1",), with_verifier=False)
    agents = build_agents({"solver": AgentConfig(policy="default")}, tok, default_kinds=maker.default_agents)
    slow = ScriptedEngine(tok, fixed("5"), delay_s=5.0)
    result = asyncio.run(run_episodes(build_orchestra("sequential"), maker, maker.tasks(2), agents=agents,
                                      engines={"default": slow}, episode_timeout_s=0.05))
    assert result.reasons() == {"episode_timeout": 2} and result.samples == []


@pytest.mark.slow
def test_ray_actors_crash_and_timeout():
    pytest.importorskip("ray")
    import ray

    workers = make_workers(kind="ray", num_workers=2, timeout_s=3.0)
    try:
        result = _rollout(workers, ["none", "crash", "hang", "none"], step_timeout_s=3.0)
        assert [e.status for e in result.episodes] == ["ok", "failed", "failed", "ok"]
        assert result.reasons() == {"env_worker:crash": 1, "env_worker:timeout": 1}
    finally:
        workers.close()
        ray.shutdown()
