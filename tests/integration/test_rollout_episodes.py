"""Rollouts with the real HF engine on a tiny random Llama (SmolLM2 tokenizer): many concurrent
episodes finish and every Sample carries correct (task, agent, turn, branch) tags and exact tokens."""

import asyncio
from collections import defaultdict

import pytest

from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine_and_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megamarl.models.packaged import save_tiny_model
    from megamarl.rollout.engines.hf import HFEngine

    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, max_batch_rows=64, seed=0)
    yield engine, tokenizer
    engine.shutdown()


def _check_tags(result, tree_agents=None):
    tree_agents = tree_agents or {}
    by_episode = defaultdict(list)
    for sample in result.samples:
        by_episode[sample.episode_id].append(sample)
        assert sample.episode_id.startswith(sample.task_id + "/")
        assert len(sample.rollout_logprobs) == len(sample.response_ids) > 0
        assert sample.policy == "default" and sample.weight_version == 0
    for samples in by_episode.values():
        groups = defaultdict(list)
        for sample in samples:
            groups[(sample.agent, sample.turn)].append(sample)
        for (agent, _turn), group in groups.items():
            assert [s.branch for s in group] == list(range(tree_agents.get(agent, 1)))
            assert len({tuple(s.prompt_ids) for s in group}) == 1  # all K candidates share one prompt
            assert len({s.step for s in group}) == 1
        for agent in {s.agent for s in samples}:
            assert sorted({t for a, t in groups if a == agent}) == list(
                range(len({t for a, t in groups if a == agent}))
            )
        assert sorted({s.step for s in samples}) == list(range(len({s.step for s in samples})))


def test_64_concurrent_math_solver_verifier_episodes(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    maker = EnvMaker("math")
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    configs = {
        "solver": AgentConfig(policy="default", sampling=sampling, multi_turn=True),
        "verifier": AgentConfig(policy="default", sampling=sampling),
    }
    agents = build_agents(configs, tokenizer, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", max_loops=2),
            maker,
            maker.tasks(16, seed=0),
            agents=agents,
            engines={"default": engine},
            group_size=4,
            max_concurrency=64,
        )
    )
    assert len(result.episodes) == 64 and result.num_failed == 0 and result.num_dropped == 0
    assert {s.agent for s in result.samples} == {"solver", "verifier"}
    assert len({s.task_id for s in result.samples}) == 16
    _check_tags(result)
    # token-exact multi-turn: a later solver prompt extends the earlier prompt + reply verbatim
    solver_turns = defaultdict(dict)
    for s in result.samples:
        if s.agent == "solver":
            solver_turns[s.episode_id][s.turn] = s
    for turns in solver_turns.values():
        if 1 in turns:
            prefix = turns[0].prompt_ids + turns[0].response_ids
            assert turns[1].prompt_ids[: len(prefix)] == prefix
    assert all(s.team_reward in (0.0, 1.0) for s in result.samples)


def test_16_tree_sampled_planning_episodes(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    maker = EnvMaker("grid", size=4, max_actions=12)
    configs = {
        "planner": AgentConfig(policy="default", sampling=SamplingConfig(max_tokens=8)),
        "executor": AgentConfig(policy="default", sampling=SamplingConfig(max_tokens=8), tree_k=4),
    }
    agents = build_agents(configs, tokenizer, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential", max_steps=4),
            maker,
            maker.tasks(8, seed=0),
            agents=agents,
            engines={"default": engine},
            group_size=2,
        )
    )
    assert len(result.episodes) == 16 and result.num_failed == 0
    _check_tags(result, tree_agents={"executor": 4})
    executor = [s for s in result.samples if s.agent == "executor"]
    assert len(executor) == 16 * 2 * 4  # 2 executor turns per episode, 4 branches each
    assert all(0.0 <= s.local_reward <= 1.0 for s in executor)
