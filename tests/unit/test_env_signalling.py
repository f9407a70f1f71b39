"""Signalling game: one-symbol messages, digit guesses, team reward exact."""

import asyncio

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.orchestration.envs.signalling import SYMBOLS


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_symbols_and_digits_are_single_tokens(tok):
    for symbol in SYMBOLS + tuple("0123456789"):
        assert len(tok.encode(symbol, add_special_tokens=False)) == 1


def _play(tok, sender, receiver, num_tasks=10):
    maker = EnvMaker("signalling")
    agents = build_agents(
        {
            "sender": AgentConfig(policy="default", sampling=SamplingConfig(max_tokens=1)),
            "receiver": AgentConfig(policy="default", sampling=SamplingConfig(max_tokens=2)),
        },
        tok,
        default_kinds=maker.default_agents,
    )

    def policy(request):
        return (
            sender(request.last_user)
            if "secret digit is" in request.last_user
            else receiver(request.last_user)
        )

    return asyncio.run(
        run_episodes(
            build_orchestra("sequential", max_steps=4),
            maker,
            maker.tasks(num_tasks, seed=0),
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )


def test_shared_code_always_succeeds(tok):
    def sender(obs):
        return SYMBOLS[int(obs.split("secret digit is ")[1][0])]

    def receiver(obs):
        return str(SYMBOLS.index(obs.split("letter: ")[1][0]))

    result = _play(tok, sender, receiver)
    assert [e.team_reward for e in result.episodes] == [1.0] * 10
    assert [(s.agent, s.turn, len(s.response_ids)) for s in result.samples[:2]] == [
        ("sender", 0, 1),
        ("receiver", 0, 2),
    ]
    assert sorted(int(t.payload) for t in EnvMaker("signalling").tasks(10, seed=0)) == list(range(10))


def test_constant_strategy_succeeds_once_in_ten(tok):
    result = _play(tok, lambda obs: "A", lambda obs: "3")
    assert sum(e.team_reward for e in result.episodes) == 1.0


def test_invalid_symbol_is_flagged(tok):
    result = _play(tok, lambda obs: "z", lambda obs: "?" if "?" in obs else "0", num_tasks=1)
    sender, receiver = result.samples
    assert (sender.valid, receiver.valid, receiver.team_reward) == (False, False, 0.0)
