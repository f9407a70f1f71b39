"""TextArena adapter: a scripted game to the end (exact rewards, winner, invalid moves as TextArena
reports them), episodes through the sequential orchestra in TextArena's turn order, determinism by
seed, and the load-time errors (missing package, unknown game, players)."""

import asyncio
import importlib.util
import random
import re

import numpy as np
import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import Action, AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.envs import textarena as adapter

# every test but the missing-package one plays real TextArena games (the `textarena` extra; CI has it)
needs_textarena = pytest.mark.skipif(
    importlib.util.find_spec("textarena") is None, reason="needs the textarena extra"
)


def _act(env, agent, text):
    action = Action(agent=agent, text=text, value=text.strip(), valid=bool(text.strip()), turn=0, step=0)
    return env.step(agent, action)


def _tictactoe(**kwargs):
    maker = EnvMaker("textarena", game="TicTacToe-v0", **kwargs)
    return maker(maker.tasks(1, seed=0)[0])


@needs_textarena
def test_scripted_tictactoe_to_the_end_with_exact_rewards_and_winner():
    env = _tictactoe()
    assert env.agents == ("player_0", "player_1") and env.active_agents() == ["player_0"]
    assert "Available Moves: '[0]'" in env.observe("player_0")
    with pytest.raises(ValueError, match="'player_0' acts now"):
        env.observe("player_1")
    assert not _act(env, "player_0", "0").invalid  # the bare "0" becomes "[0]" (TextArena's wrapper)
    assert not _act(env, "player_1", "[3]").invalid
    # an occupied cell: TextArena reports it and gives the same player a retry
    assert _act(env, "player_0", "[3]").invalid
    assert env.active_agents() == ["player_0"] and "already occupied" in env.observe("player_0")
    assert not _act(env, "player_0", "1").invalid
    assert not _act(env, "player_1", "4").invalid
    assert not env.done and env.agent_reward("player_0") == 0.0
    assert not _act(env, "player_0", "2").invalid  # 0 1 2: the top row
    assert env.done and env.active_agents() == []
    assert {a: env.agent_reward(a) for a in env.agents} == {"player_0": 1.0, "player_1": -1.0}
    assert env.team_reward() == 0.0  # competitive: each trains on its own reward
    assert env.agent_success("player_0") is True and env.agent_success("player_1") is False
    assert env.success()
    assert env.metrics() == {"turns": 6.0, "invalid_moves": 1.0, "unfinished": 0.0}
    with pytest.raises(ValueError, match="the game is over"):
        _act(env, "player_1", "5")


@needs_textarena
def test_second_invalid_move_forfeits_and_named_players():
    env = _tictactoe(players=["x", "o"])
    assert env.agents == ("x", "o")
    assert _act(env, "x", "[9]").invalid  # out of the board: a retry
    assert _act(env, "x", "no move").invalid and env.done  # the allowance is spent: x forfeits
    assert {a: env.agent_reward(a) for a in env.agents} == {"x": -1.0, "o": 1.0}
    assert env.agent_success("o") and not env.agent_success("x")


@needs_textarena
def test_draw_and_unfinished_games_have_no_winner():
    env = _tictactoe()
    for i, cell in enumerate([0, 1, 2, 4, 3, 5, 7, 6, 8]):  # O X O / O X X / X O O: a draw
        _act(env, env.agents[i % 2], str(cell))
    assert env.done and {a: env.agent_reward(a) for a in env.agents} == {"player_0": 0.0, "player_1": 0.0}
    assert not env.success() and not env.agent_success("player_0")
    cut = _tictactoe()
    _act(cut, "player_0", "4")
    assert cut.agent_reward("player_0") == 0.0 and not cut.success() and cut.metrics()["unfinished"] == 1.0


@needs_textarena
def test_episodes_follow_textarenas_turn_order_through_the_sequential_orchestra():
    """KuhnPoker deals by the seed and may start with player 1; every reply is the first legal action."""
    tok = smollm2_tokenizer()

    def policy(request):
        return re.findall(r"'(\[\w+\])'", request.last_user)[0]

    configs = {p: AgentConfig(policy="default", kind="text") for p in ("player_0", "player_1")}
    maker = EnvMaker("textarena", game="KuhnPoker-v0")

    def run():
        return asyncio.run(
            run_episodes(
                build_orchestra("sequential", max_steps=40),
                maker,
                maker.tasks(3, seed=0),
                agents=build_agents(configs, tok),
                engines={"default": ScriptedEngine(tok, policy, delay_s=0.001)},
                group_size=2,
            )
        )

    first, second = run(), run()
    assert all(e.status == "ok" and e.env_done for e in first.episodes)
    assert all(s.valid for s in first.samples)
    for episode in first.episodes:  # check-check every round: the higher card takes each pot
        rewards = {s.agent: s.local_reward for s in first.samples if s.episode_id == episode.episode_id}
        assert sorted(rewards.values()) in ([-1.0, 1.0], [0.0, 0.0])
        winners = [a for a, won in episode.agent_success.items() if won]
        assert winners == [a for a, r in rewards.items() if r == 1.0]
    # determinism: the same seeds deal the same cards, whatever the interleaving of the episodes
    assert [(s.agent, s.response_ids, s.local_reward) for s in first.samples] == [
        (s.agent, s.response_ids, s.local_reward) for s in second.samples
    ]


@needs_textarena
def test_same_seed_same_game_and_the_global_random_state_untouched():
    maker = EnvMaker("textarena", game="KuhnPoker-v0")
    tasks = maker.tasks(8, seed=3)
    random.seed(123)
    np.random.seed(123)
    outer, np_outer = random.getstate(), np.random.get_state()[1].copy()
    envs = [maker(t) for t in tasks]
    again = [maker(t) for t in tasks]
    assert random.getstate() == outer and (np.random.get_state()[1] == np_outer).all()
    assert [(e.current, e.observation) for e in envs] == [(e.current, e.observation) for e in again]
    assert len({e.observation for e in envs}) > 1  # the seed deals: not every game starts alike
    assert maker.tasks(8, seed=3) == tasks


def test_missing_package_is_a_load_time_error_naming_the_extra(monkeypatch):
    real = adapter.importlib.util.find_spec
    monkeypatch.setattr(
        adapter.importlib.util, "find_spec", lambda name, *a: None if name == "textarena" else real(name, *a)
    )
    hint = r"needs the 'textarena' package.*megamarl\[textarena\].*--extras textarena"
    with pytest.raises(ValueError, match=hint):
        adapter.TextArenaConfig(game="TicTacToe-v0")


@needs_textarena
def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="env.kwargs.game must name"):
        adapter.TextArenaConfig()
    with pytest.raises(ValueError, match=r"not a registered TextArena env; did you mean \['TicTacToe-v0'"):
        adapter.TextArenaConfig(game="TicTacToe-v9")
    with pytest.raises(ValueError, match="env.kwargs.players names 3 roles"):
        adapter.TextArenaConfig(game="TicTacToe-v0", players=["a", "b", "c"])
    with pytest.raises(ValueError, match="distinct"):
        adapter.TextArenaConfig(game="TicTacToe-v0", players=["a", "a"])


def test_policy_mappings_swap_seats_by_seed():
    assert [adapter.learner_vs_pool(a, 4) for a in ("player_0", "player_1")] == ["alpha", "opponent"]
    assert [adapter.learner_vs_pool(a, 5) for a in ("player_0", "player_1")] == ["opponent", "alpha"]
    assert [adapter.alpha_vs_beta(a, 5) for a in ("player_0", "player_1")] == ["beta", "alpha"]
