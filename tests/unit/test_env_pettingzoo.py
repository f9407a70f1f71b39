"""PettingZoo adapter: the repo's games pass PettingZoo's api_test; text hooks, action masks and
invalid-action outcomes, competitive scoring, and per-episode policy mapping (self-play)."""

import asyncio

import numpy as np
import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.agents import AGENTS, Agent, last_number
from megamarl.orchestration.context import ConfigError
from megamarl.orchestration.envs.pettingzoo_games import CountingAECGame, EchoParallelGame
from megamarl.orchestration.envs.pettingzoo_text import InvalidAction, parse_action, render_observation

pettingzoo = pytest.importorskip("pettingzoo")
spaces = pytest.importorskip("gymnasium.spaces")

TOY_GAMES = "megamarl.orchestration.envs.pettingzoo_games"
GAMES = "megamarl.orchestration.envs.games"


@AGENTS.register("testing_counter")
class Counter(Agent):
    def parse(self, text):
        value, ok = last_number(text)
        return (int(value) if ok else None), ok


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _tictactoe():
    pytest.importorskip("pygame")  # pettingzoo.classic imports it
    from megamarl.orchestration.envs.games import make_tictactoe

    return make_tictactoe(0)


# ---- every game the repo ships passes PettingZoo's own API test ----------------------------------
def test_games_pass_pettingzoo_api_test():
    from pettingzoo.test import api_test, parallel_api_test

    assert isinstance(EchoParallelGame(), pettingzoo.ParallelEnv)
    assert isinstance(CountingAECGame(), pettingzoo.AECEnv)
    parallel_api_test(EchoParallelGame(), num_cycles=50)
    api_test(CountingAECGame(), num_cycles=50)
    api_test(_tictactoe(), num_cycles=50)


# ---- default text hooks ---------------------------------------------------------------------------
def test_default_parse_per_space():
    assert parse_action("I take cell 3, no, 7", spaces.Discrete(9)) == 7
    assert parse_action("move 2", spaces.Discrete(3, start=1)) == 2
    with pytest.raises(InvalidAction):
        parse_action("9", spaces.Discrete(9))  # out of the space
    with pytest.raises(InvalidAction):
        parse_action("no idea", spaces.Discrete(9))
    assert parse_action("go 1 then 2 4", spaces.MultiDiscrete([3, 5])).tolist() == [2, 4]
    box = parse_action("steer -0.5, throttle 1e-1", spaces.Box(-1.0, 1.0, (2,), np.float32))
    assert box.tolist() == [-0.5, pytest.approx(0.1)]
    with pytest.raises(InvalidAction):
        parse_action("1.5 0", spaces.Box(-1.0, 1.0, (2,), np.float32))
    assert parse_action("  red \n", spaces.Text(8)) == "red"


def test_default_render_lists_legal_actions_not_numpy_reprs():
    obs = {
        "observation": np.array([[1, 0], [0, 2]], dtype=np.int8),
        "action_mask": np.array([0, 1, 1, 0], np.int8),
    }
    assert render_observation(obs) == "[[1, 0], [0, 2]]\nLegal actions: 1, 2"
    assert render_observation({"hp": np.int64(3), "name": "orc"}) == "hp: 3\nname: orc"


# ---- episodes through the adapter -------------------------------------------------------------------
def _run(tok, maker, orchestra, configs, engines, num_tasks=2, group_size=1, policy_mapping=None):
    agents = build_agents(configs, tok)
    if callable(engines):
        engines = {"default": ScriptedEngine(tok, engines)}
    return asyncio.run(
        run_episodes(
            orchestra,
            maker,
            maker.tasks(num_tasks, seed=0),
            agents=agents,
            engines=engines,
            group_size=group_size,
            policy_mapping=policy_mapping,
        )
    )


def test_parallel_game(tok):
    def policy(request):  # alice says the word, bob always says "red"
        word = request.last_user.split("Say the word: ")[1]
        return word if "alice" in request.system else "red"

    configs = {a: AgentConfig(policy="default", kind="text", system_prompt=a) for a in ("alice", "bob")}
    maker = EnvMaker("pettingzoo_parallel", factory=f"{TOY_GAMES}:make_echo_parallel")
    result = _run(tok, maker, build_orchestra("simultaneous", max_rounds=5), configs, policy)
    first = [s for s in result.samples if s.episode_id == result.episodes[0].episode_id]
    assert [(s.agent, s.turn) for s in first] == [("alice", 0), ("bob", 0), ("alice", 1), ("bob", 1)]
    words = ("red", "green", "blue")
    bob_hits = sum(words[(seed + r + 1) % 3] == "red" for seed in (0, 1) for r in range(2))  # task seeds 0, 1
    assert [s.local_reward for s in first if s.agent == "alice"] == [2.0, 2.0]
    assert sum(e.team_reward for e in result.episodes) == 4 + bob_hits
    assert all(e.env_done for e in result.episodes)
    # team scoring: an agent succeeds when its own return is > 0; alice always does
    assert [e.agent_success["alice"] for e in result.episodes] == [True, True]


def test_aec_game_with_render_hook_counts_until_mistake(tok):
    def policy(request):
        count = int(request.last_user.split("The count is ")[1].split(".")[0])
        return "99" if count >= 2 else f"{count} + 1 = {count + 1}"

    configs = {p: AgentConfig(policy="default", kind="testing_counter") for p in ("p0", "p1")}
    maker = EnvMaker(
        "pettingzoo_aec",
        factory=f"{TOY_GAMES}:make_counting_aec",
        render=f"{TOY_GAMES}:render_count",
        invalid_outcome="pass",
    )
    result = _run(tok, maker, build_orchestra("sequential", max_steps=20), configs, policy)
    # task 0: seed 0 -> count 0: p0 says 1, p1 says 2, p0 says 99 (legal in Discrete(100), wrong) ->
    # terminated
    first = [s for s in result.samples if s.episode_id == result.episodes[0].episode_id]
    assert [s.agent for s in first] == ["p0", "p1", "p0"]
    assert [s.local_reward for s in first] == [1.0, 1.0, 1.0]  # per-agent episode totals: p0 1, p1 1
    assert all(s.valid for s in first)
    assert result.episodes[0].team_reward == 2.0 and result.episodes[0].env_done
    # task 1: seed 1 -> count 1: p0 says 2, p1 says 99
    assert result.episodes[1].team_reward == 1.0
    assert result.episodes[1].agent_success == {"p0": True, "p1": False}


def _ttt_maker(**kwargs):
    _tictactoe()
    return EnvMaker(
        "pettingzoo_aec",
        factory=f"{GAMES}:make_tictactoe",
        render=f"{GAMES}:render_tictactoe",
        scoring="competitive",
        **kwargs,
    )


def _script(moves):
    """Players read the board and play the first of ``moves[seat]`` that is still free."""

    def policy(request):
        text = request.last_user
        free = text.split("Free cells: ")[1].split(".")[0].split()
        seat = "X" if "You play X" in text else "O"
        return next(m for m in moves[seat] if m in free)

    return policy


TTT_AGENTS = {p: AgentConfig(policy="default", kind="text") for p in ("player_1", "player_2")}


def test_tictactoe_competitive_scoring(tok):
    # X takes the left column 0, 1, 2 (cells are numbered by column); O plays 4, 5
    policy = _script({"X": ["0", "1", "2"], "O": ["4", "5", "8"]})
    result = _run(
        tok, _ttt_maker(), build_orchestra("sequential", max_steps=9), TTT_AGENTS, policy, num_tasks=1
    )
    episode = result.episodes[0]
    assert [s.agent for s in result.samples] == ["player_1", "player_2"] * 2 + ["player_1"]
    assert [s.response_text for s in result.samples] == ["0", "4", "1", "5", "2"]
    assert {s.agent: s.local_reward for s in result.samples} == {"player_1": 1.0, "player_2": -1.0}
    assert episode.team_reward == 0.0  # competitive: no shared reward (the zero-sum sum is not "failure")
    assert episode.success and episode.agent_success == {"player_1": True, "player_2": False}
    assert (
        "You play X.\nX | 3 | 6\n1 | O | 7\n2 | 5 | 8\nFree cells: 1 2 3 5 6 7 8." in result.samples[2].anchor
    )


def test_tictactoe_draw_is_nobodys_success(tok):
    # cells are numbered by column; X0 O4 X8 O2 X6 O3 X5 O7 X1 fills the board with no line
    order = iter(["0", "4", "8", "2", "6", "3", "5", "7", "1"])
    result = _run(
        tok,
        _ttt_maker(),
        build_orchestra("sequential", max_steps=9),
        TTT_AGENTS,
        lambda r: next(order),
        num_tasks=1,
    )
    episode = result.episodes[0]
    assert len(result.samples) == 9 and episode.env_done
    assert {s.local_reward for s in result.samples} == {0.0}
    assert not episode.success and episode.agent_success == {"player_1": False, "player_2": False}


@pytest.mark.parametrize("outcome", ["lose", "random"])
def test_illegal_move_outcomes(tok, outcome):
    replies = iter(["4", "4", "0"] + ["1", "2", "3", "5", "6", "7", "8"] * 2)  # O repeats X's cell
    result = _run(
        tok,
        _ttt_maker(invalid_outcome=outcome),
        build_orchestra("sequential", max_steps=9),
        TTT_AGENTS,
        lambda r: next(replies),
        num_tasks=1,
    )
    samples = result.samples
    assert [s.valid for s in samples[:2]] == [True, False]
    if outcome == "lose":  # the offender forfeits at once
        assert len(samples) == 2 and result.episodes[0].num_invalid == 1 and result.episodes[0].env_done
        assert {s.agent: s.local_reward for s in samples} == {"player_1": 0.0, "player_2": -1.0}
        assert result.episodes[0].agent_success == {"player_1": True, "player_2": False}
    else:  # a seeded random legal cell is played for O, and the game goes on
        assert len(samples) > 2
        assert "O" in samples[2].anchor.split("Free cells")[0].split("You play X.")[1]


def test_policy_mapping_binds_seats_per_episode(tok):
    from megamarl.orchestration.envs.games import tictactoe_self_play

    engines = {
        name: ScriptedEngine(tok, _script({"X": ["0", "1", "2"], "O": ["4", "5", "8"]}))
        for name in ("alpha", "beta")
    }
    result = _run(
        tok,
        _ttt_maker(),
        build_orchestra("sequential", max_steps=9),
        TTT_AGENTS,
        engines,
        num_tasks=2,
        group_size=4,
        policy_mapping=tictactoe_self_play,
    )
    seats = []
    for episode in result.episodes:
        tags = {(s.agent, s.policy) for s in result.samples if s.episode_id == episode.episode_id}
        assert tags == set(episode.policies.items())  # samples carry the policy that produced them
        assert episode.policies["player_1"] != episode.policies["player_2"]
        seats.append(episode.policies["player_1"])
    assert set(seats) == {"alpha", "beta"}  # both policies played X within 8 episodes
    assert len(engines["alpha"].requests) == sum(s.policy == "alpha" for s in result.samples)

    with pytest.raises(ConfigError, match="rollout.policy_mapping gave 'player_1' policy 'gamma'"):
        _run(
            tok,
            _ttt_maker(),
            build_orchestra("sequential"),
            TTT_AGENTS,
            engines,
            num_tasks=1,
            policy_mapping=lambda agent, seed: "gamma",
        )


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="module:function"):
        EnvMaker("pettingzoo_aec", factory="nocolon")
    with pytest.raises(ValueError, match="env.kwargs.render"):
        EnvMaker(
            "pettingzoo_aec", factory=f"{TOY_GAMES}:make_counting_aec", render=f"{TOY_GAMES}:no_such_hook"
        )
    with pytest.raises(ValueError, match="env.kwargs.invalid_outcome"):
        EnvMaker("pettingzoo_aec", factory=f"{TOY_GAMES}:make_counting_aec", invalid_outcome="retry")
    with pytest.raises(ValueError, match="env.kwargs.scoring"):
        EnvMaker("pettingzoo_aec", factory=f"{TOY_GAMES}:make_counting_aec", scoring="zero_sum")


def test_tictactoe_config_loads_and_rejects_bad_mappings(tmp_path):
    from pathlib import Path

    from megamarl.cli.configure import load_config

    _tictactoe()
    path = Path(__file__).resolve().parents[2] / "configs" / "tictactoe.yaml"
    cfg = load_config(path)
    assert cfg.rollout.policy_mapping.endswith(":tictactoe_self_play")
    with pytest.raises(ValueError, match=r"rollout.policy_mapping\('player_1', 0\) returned 'gamma'"):
        load_config(path, ["rollout.policy_mapping=scripted:map_to_gamma"])
    with pytest.raises(ValueError, match="rollout.policy_mapping must be 'module:function'"):
        load_config(path, ["rollout.policy_mapping=nocolon"])
