"""PettingZoo adapter on tiny text games implementing the Parallel and AEC APIs."""

import asyncio

import pytest

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.agents import AGENTS, Agent, last_number
from megamarl.orchestration.testing import CountingAECGame, EchoParallelGame, ScriptedEngine, smollm2_tokenizer


@AGENTS.register("testing_counter")
class Counter(Agent):
    def parse(self, text):
        value, ok = last_number(text)
        return (int(value) if ok else None), ok


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_games_subclass_pettingzoo_bases():
    pettingzoo = pytest.importorskip("pettingzoo")
    assert isinstance(EchoParallelGame(), pettingzoo.ParallelEnv)
    assert isinstance(CountingAECGame(), pettingzoo.AECEnv)


def _run(tok, name, factory, orchestra, configs, policy, num_tasks=2):
    maker = EnvMaker(name, factory=f"megamarl.orchestration.testing:{factory}")
    agents = build_agents(configs, tok)
    return asyncio.run(run_episodes(orchestra, maker, maker.tasks(num_tasks, seed=0), agents=agents,
                                    engines={"default": ScriptedEngine(tok, policy)}))


def test_parallel_game(tok):
    def policy(request):  # alice says the word, bob always says "red"
        word = request.last_user.split("Say the word: ")[1]
        return word if "alice" in request.system else "red"

    configs = {a: AgentConfig(kind="text", system_prompt=a) for a in ("alice", "bob")}
    result = _run(tok, "pettingzoo_parallel", "make_echo_parallel", build_orchestra("simultaneous", max_rounds=5), configs, policy)
    first = [s for s in result.samples if s.episode_id == result.episodes[0].episode_id]
    assert [(s.agent, s.turn) for s in first] == [("alice", 0), ("bob", 0), ("alice", 1), ("bob", 1)]
    words = ("red", "green", "blue")
    bob_hits = sum(words[(seed + r + 1) % 3] == "red" for seed in (0, 1) for r in range(2))  # task seeds 0, 1
    assert [s.local_reward for s in first if s.agent == "alice"] == [2.0, 2.0]
    assert sum(e.team_reward for e in result.episodes) == 4 + bob_hits
    assert all(e.env_done for e in result.episodes)


def test_aec_game_counts_until_mistake(tok):
    def policy(request):
        count = int(request.last_user.split("The count is ")[1].split(".")[0])
        return "99" if count >= 2 else f"{count} + 1 = {count + 1}"

    configs = {p: AgentConfig(kind="testing_counter") for p in ("p0", "p1")}
    result = _run(tok, "pettingzoo_aec", "make_counting_aec", build_orchestra("sequential", max_steps=20), configs, policy)
    # task 0: seed 0 -> count 0: p0 says 1, p1 says 2, p0 says 99 (wrong) -> terminated
    first = [s for s in result.samples if s.episode_id == result.episodes[0].episode_id]
    assert [s.agent for s in first] == ["p0", "p1", "p0"]
    assert [s.local_reward for s in first] == [1.0, 1.0, 1.0]  # per-agent episode totals: p0 1, p1 1
    assert result.episodes[0].team_reward == 2.0 and result.episodes[0].env_done
    # task 1: seed 1 -> count 1: p0 says 2, p1 says 99
    assert result.episodes[1].team_reward == 1.0


def test_bad_factory_fails_at_config_time():
    with pytest.raises(ValueError, match="module:function"):
        EnvMaker("pettingzoo_aec", factory="nocolon")
