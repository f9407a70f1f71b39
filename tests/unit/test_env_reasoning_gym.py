"""reasoning-gym env: seeded tasks from its generators, its own scorer's numbers mapped to the team's and
each agent's rewards (a hand example), load-time config errors, and the missing-package error."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import socket
from pathlib import Path

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.env import Task
from megamarl.orchestration.envs import reasoning_gym as rg_env
from megamarl.orchestration.envs.reasoning_gym import (
    DatasetSpec,
    ReasoningGymConfig,
    ReasoningGymProblem,
    extract_tagged_answer,
)

ROOT = Path(__file__).resolve().parents[2]
needs_package = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="the reasoning-gym extra is not installed (bash scripts/setup.sh --extras reasoning-gym)",
)
MIX = (
    {"name": "chain_sum", "weight": 3, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
    "leg_counting",
    {"name": "count_bits"},
)


@pytest.fixture
def no_network(monkeypatch):
    """Generation and scoring must not reach any hub: every connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@needs_package
def test_tasks_are_seeded_and_scored_by_their_own_generator(no_network):
    maker = EnvMaker("reasoning_gym", datasets=MIX)
    tasks = maker.tasks(40, seed=3)
    assert tasks == maker.tasks(40, seed=3) and tasks != maker.tasks(40, seed=4)
    assert maker.tasks(10, seed=3) == tasks[:10]  # a task is a function of (config, seed, its index)
    names = [t.task_id.split("-", 3)[-1] for t in tasks]
    assert set(names) == {"chain_sum", "leg_counting", "count_bits"} and names.count("chain_sum") > 40 / 3
    for task in tasks:  # the generator's oracle answer gets full marks from the dataset's own scorer
        assert rg_env.score_answer(task.payload, task.payload.entry["answer"]) == (1.0, True)
    sums = [t.payload for t in tasks if t.task_id.endswith("chain_sum")]
    assert all(p.question.count("+") + p.question.count("-") == 1 for p in sums)  # its config reached it


def test_answer_extraction():
    assert extract_tagged_answer("I think <answer> 7 </answer>, no: <answer>8</answer>") == ("8", True)
    assert extract_tagged_answer("  It is 16\n") == ("It is 16", True)  # no tags: the whole reply
    assert extract_tagged_answer("<answer></answer>") == (None, False)
    assert extract_tagged_answer("   ") == (None, False)


def _hand_task() -> Task:
    """chain_sum's scorer is reasoning-gym's default: 1 for the exact answer, len(answer) /
    len(reply) when the answer is inside the reply, else 0."""
    entry = {"question": "What is 1 + 5?", "answer": "6", "metadata": {}}
    return Task("hand", ReasoningGymProblem(DatasetSpec("chain_sum").key(), entry["question"], entry))


def _episode(solver_replies, verifier_replies, *, correct_at=1.0):
    tok = smollm2_tokenizer()
    maker = EnvMaker("reasoning_gym", datasets=("chain_sum",), correct_at=correct_at)
    agents = build_agents(
        {"solver": AgentConfig(policy="default"), "verifier": AgentConfig(policy="default")},
        tok,
        default_kinds=maker.default_agents,
    )
    solver, verifier = iter(solver_replies), iter(verifier_replies)

    def policy(request):
        return next(verifier) if "Proposed answer" in request.last_user else next(solver)

    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", max_loops=2),
            maker,
            [_hand_task()],
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )
    (episode,) = result.episodes
    return episode, [(s.agent, s.local_reward) for s in result.samples]


@needs_package
def test_scores_map_to_team_and_agent_rewards_on_a_hand_example():
    # "16" contains "6": 1/2. The verifier's truth is score >= correct_at (1.0): wrong, so its "yes"
    # earns 0, and the approval ends the episode with the team reward 0.5.
    episode, rewards = _episode(["<answer>16</answer>"], ["yes"])
    assert rewards == [("solver", 0.5), ("verifier", 0.0)]
    assert (episode.team_reward, episode.success) == (0.5, False)
    # untagged: the whole reply is the answer, "6" of "It is 16" = 1/8; "no" is right (1) and sends the
    # answer back; the second answer is exact (1), the verifier's "yes" is right (1).
    episode, rewards = _episode(["It is 16", "<answer>6</answer>"], ["no", "yes"])
    assert rewards == [("solver", 0.125), ("verifier", 1.0), ("solver", 1.0), ("verifier", 1.0)]
    assert (episode.team_reward, episode.success) == (1.0, True)
    # correct_at=0.5 makes the half-right answer "correct": the same "yes" now earns the verifier 1
    episode, rewards = _episode(["<answer>16</answer>"], ["yes"], correct_at=0.5)
    assert rewards == [("solver", 0.5), ("verifier", 1.0)] and episode.success


@needs_package
def test_a_scorer_that_raises_scores_zero_and_is_counted():
    entry = {"question": "Factor 12", "answer": "2 × 2 × 3", "metadata": {}}
    problem = ReasoningGymProblem(DatasetSpec("prime_factorization").key(), entry["question"], entry)
    assert rg_env.score_answer(problem, "twelve") == (0.0, False)  # its int() raises on a word
    assert rg_env.score_answer(problem, "3 × 2 × 2") == (1.0, True)


@needs_package
@pytest.mark.parametrize(
    "datasets, message",
    [
        (("no_such_task",), "datasets[0].name='no_such_task' is no reasoning-gym dataset"),
        (("composite",), "datasets[0].name='composite' is no reasoning-gym dataset"),
        (({"name": "chain_sum", "config": {"min_terms": 0}},), "datasets[0].config for 'chain_sum'"),
        (({"name": "chain_sum", "config": {"terms": 2}},), "datasets[0].config for 'chain_sum'"),
        (({"name": "chain_sum", "config": {"seed": 1}},), "datasets[0].config sets ['seed']"),
        (({"name": "chain_sum", "weight": 0},), "datasets[0].weight must be > 0"),
        (("chain_sum", {"name": "chain_sum"}), "names a dataset twice"),
        ((), "datasets is empty"),
    ],
)
def test_bad_datasets_are_rejected_naming_the_key(datasets, message):
    with pytest.raises(ValueError, match="env.kwargs.datasets") as error:
        ReasoningGymConfig(datasets=datasets)
    assert message in str(error.value)


def test_a_missing_package_is_a_load_time_error_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a)
    )
    from megamarl.cli.configure import load_config

    with pytest.raises(ValueError) as error:
        load_config(ROOT / "configs" / "presets" / "reasoning_gym.yaml")
    assert "pip install 'megamarl[reasoning-gym]'" in str(error.value)
    assert "scripts/setup.sh --extras reasoning-gym" in str(error.value)


def test_the_package_is_imported_only_when_a_config_names_the_env():
    """No module-level import of reasoning_gym (it costs ~4 CPU-s: sympy, matplotlib): megamarl
    registers the env without it, and runs without the extra unless a config names the env."""
    tree = ast.parse(Path(rg_env.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "reasoning_gym"], names
