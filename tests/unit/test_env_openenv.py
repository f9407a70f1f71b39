"""OpenEnv adapter: Relay (an OpenEnv env, megamarl/orchestration/envs/openenv_relay.py) played by a
speaker and a listener with exact rewards, and as episodes through the sequential orchestra; the echo
env ``openenv init`` writes (OpenEnv's own template, its ``reset`` takes no seed); an action parsed
from a reply's JSON, a reply that makes none (invalid, the env not stepped), roles in turn; the
load-time errors (missing package, not an Environment, fields, an action type it cannot infer)."""

import asyncio
import importlib.util
import re
import sys
from typing import Any

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import Action, AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.envs import openenv as adapter

# every test but the missing-package one builds real OpenEnv envs (the `openenv` extra; CI has it)
needs_openenv = pytest.mark.skipif(
    importlib.util.find_spec("openenv") is None, reason="needs the openenv extra"
)
RELAY = "megamarl.orchestration.envs.openenv_relay:RelayEnvironment"
RELAY_KWARGS = {
    "environment": RELAY,
    "roles": ["speaker", "listener"],
    "turn_field": "next_role",
    "role_field": "role",
    "observation_field": "prompt",
}


def _act(env, agent, text):
    return env.step(agent, Action(agent=agent, text=text, value=text, valid=True, turn=0, step=0))


def _relay(seed=0):
    maker = EnvMaker("openenv", **RELAY_KWARGS)
    return maker(maker.tasks(1, seed=seed)[0])


@needs_openenv
def test_relay_played_by_speaker_and_listener_with_exact_rewards():
    env = _relay()
    secret = env.environment.state.secret
    assert env.agents == ("speaker", "listener") and env.active_agents() == ["speaker"]
    assert f"The secret digit is {secret}." in env.observe("speaker")
    with pytest.raises(ValueError, match="'speaker' acts now"):
        env.observe("listener")
    # the reply goes into the action's one remaining required field (message), the role into `role`
    speaker = _act(env, "speaker", "7")
    assert (speaker.local_reward, speaker.invalid) == (0.0, False)
    assert env.active_agents() == ["listener"] and "said: '7'" in env.observe("listener")
    listener = _act(env, "listener", str(secret))
    assert (listener.local_reward, listener.invalid) == (1.0, False)
    assert env.done and env.active_agents() == [] and env.team_reward() == 1.0 and env.success()
    assert env.metrics() == {"turns": 2.0, "invalid_actions": 0.0, "unfinished": 0.0}
    with pytest.raises(ValueError, match="the episode is over"):
        _act(env, "listener", "1")
    wrong = _relay()
    _act(wrong, "speaker", "1")
    assert _act(wrong, "listener", str((secret + 1) % 10)).local_reward == 0.0
    assert wrong.team_reward() == 0.0 and not wrong.success()


@needs_openenv
def test_the_seed_draws_the_secret():
    secrets = [_relay(seed).environment.state.secret for seed in range(6)]
    assert secrets == [_relay(seed).environment.state.secret for seed in range(6)]
    assert len(set(secrets)) > 1


@needs_openenv
def test_relay_episodes_through_the_sequential_orchestra():
    """The speaker says the secret, the listener repeats what it heard: every episode is won."""
    tok = smollm2_tokenizer()

    def policy(request):
        return re.search(r"(?:secret digit is |said: ')(\d)", request.last_user).group(1)

    configs = {role: AgentConfig(policy="default", kind="text") for role in ("speaker", "listener")}
    maker = EnvMaker("openenv", **RELAY_KWARGS)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential", max_steps=4),
            maker,
            maker.tasks(3, seed=0),
            agents=build_agents(configs, tok),
            engines={"default": ScriptedEngine(tok, policy, delay_s=0.001)},
            group_size=2,
        )
    )
    assert len(result.episodes) == 6
    assert all(
        e.status == "ok" and e.env_done and e.success and e.team_reward == 1.0 for e in result.episodes
    )
    assert (
        sorted((s.agent, s.local_reward, s.team_reward) for s in result.samples)
        == [("listener", 1.0, 1.0)] * 6 + [("speaker", 0.0, 1.0)] * 6
    )


@pytest.fixture
def echo_env(tmp_path, monkeypatch):
    """``openenv init echo`` (OpenEnv's own template) written under tmp_path; its module spec."""
    init = importlib.import_module("openenv.cli.commands.init").init
    monkeypatch.setenv("PATH", str(tmp_path))  # no `uv lock` (it would reach for the network)
    init("echo", output_dir=str(tmp_path))
    # the template's server module imports its models as top-level `models`, as its Dockerfile runs it
    monkeypatch.syspath_prepend(str(tmp_path / "echo"))
    before = set(sys.modules)
    yield "server.echo_environment:EchoEnvironment"
    for name in ("models", "server", "server.echo_environment"):  # top-level names: leave none behind
        if name not in before:
            sys.modules.pop(name, None)


@needs_openenv
def test_the_echo_env_openenv_init_writes(echo_env):
    """reset() takes no seed; the reply is the action's only field; reward 0.1 per character; never done."""
    maker = EnvMaker("openenv", environment=echo_env)
    env = maker(maker.tasks(1, seed=0)[0])
    assert env.agents == ("agent",)
    assert env.observe("agent") == '{"echoed_message": "Echo environment ready!", "message_length": 0}'
    assert _act(env, "agent", "Hello").local_reward == pytest.approx(0.5)
    assert env.observe("agent") == '{"echoed_message": "Hello", "message_length": 5}'
    assert _act(env, "agent", "Hi!").local_reward == pytest.approx(0.3)
    assert env.team_reward() == pytest.approx(0.8) and not env.done
    assert env.metrics()["unfinished"] == 1.0


# An OpenEnv env whose action has two fields: a reply is the action's JSON.
def _ledger_module() -> Any:
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action as OpenEnvAction
    from openenv.core.env_server.types import Observation, State

    class LedgerAction(OpenEnvAction):
        op: str
        amount: int

    class LedgerObservation(Observation):
        total: int = 0

    class LedgerEnvironment(Environment):
        def __init__(self, target: int = 3) -> None:
            super().__init__()
            self.target, self.total, self._state = target, 0, State(step_count=0)
            self.num_closes = 0

        def close(self) -> None:
            self.num_closes += 1

        def reset(self, seed=None, episode_id=None, **kwargs) -> LedgerObservation:
            self.total, self._state = 0, State(episode_id=episode_id, step_count=0)
            return LedgerObservation(total=0)

        def step(self, action: LedgerAction, timeout_s=None, **kwargs) -> LedgerObservation:  # type: ignore[override]
            self._state.step_count += 1
            self.total += action.amount if action.op == "add" else -action.amount
            hit = self.total == self.target
            return LedgerObservation(total=self.total, done=hit, reward=1.0 if hit else 0.0)

        @property
        def state(self) -> State:
            return self._state

    module = type(sys)("ledger_env")
    module.LedgerEnvironment, module.LedgerAction = LedgerEnvironment, LedgerAction
    return module


@needs_openenv
def test_json_actions_invalid_replies_and_roles_in_turn(monkeypatch):
    monkeypatch.setitem(sys.modules, "ledger_env", _ledger_module())
    maker = EnvMaker(
        "openenv", environment="ledger_env:LedgerEnvironment", roles=["a", "b"], init_kwargs={"target": 3}
    )
    env = maker(maker.tasks(1, seed=0)[0])
    assert env.observe("a") == '{"total": 0}'
    assert _act(env, "a", 'I add: {"op": "add", "amount": 2} done').local_reward == 0.0
    assert env.active_agents() == ["b"]  # no turn_field: the roles act in turn
    bad = _act(env, "b", "add one")  # no JSON object: invalid, the env is not stepped, b acts again
    assert bad.invalid and bad.local_reward is None and env.environment.state.step_count == 1
    assert _act(env, "b", '{"op": "add", "amount": "x"}').invalid  # pydantic rejects the amount
    assert env.active_agents() == ["b"] and env.metrics()["invalid_actions"] == 2.0
    assert _act(env, "b", '{"op": "add", "amount": 1}').local_reward == 1.0
    assert (
        env.done
        and env.success()
        and env.metrics() == {"turns": 4.0, "invalid_actions": 2.0, "unfinished": 0.0}
    )


@needs_openenv
def test_every_episode_closes_its_environment_once(monkeypatch):
    """Episodes cut by the orchestra's max_steps before done close the OpenEnv env too; a finished
    episode closes it once (at done, not again at the episode's end)."""
    monkeypatch.setitem(sys.modules, "ledger_env", _ledger_module())
    tok = smollm2_tokenizer()
    configs = {role: AgentConfig(policy="default", kind="text") for role in ("a", "b")}
    for amount, done in ((0, False), (3, True)):  # adding 0 never reaches the target 3; adding 3 does
        maker = EnvMaker("openenv", environment="ledger_env:LedgerEnvironment", roles=["a", "b"])
        reply = f'{{"op": "add", "amount": {amount}}}'
        made = []

        def make(task, maker=maker, made=made):
            made.append(maker(task))
            return made[-1]

        result = asyncio.run(
            run_episodes(
                build_orchestra("sequential", max_steps=2),
                make,
                maker.tasks(2, seed=0),
                agents=build_agents(configs, tok),
                engines={"default": ScriptedEngine(tok, lambda _, reply=reply: reply)},
                group_size=2,
            )
        )
        assert [(e.status, e.env_done) for e in result.episodes] == [("ok", done)] * 4
        assert [env.environment.num_closes for env in made] == [1, 1, 1, 1], done


@needs_openenv
def test_a_turn_field_naming_no_role_is_an_error():
    maker = EnvMaker("openenv", **{**RELAY_KWARGS, "roles": ["a", "b"]})
    with pytest.raises(
        ValueError, match=r"turn_field='next_role': the observation names 'speaker', not one of"
    ):
        maker(maker.tasks(1, seed=0)[0])


@needs_openenv
def test_config_errors_name_the_key(monkeypatch):
    with pytest.raises(ValueError, match="env.kwargs.environment must name"):
        adapter.OpenEnvConfig()
    with pytest.raises(ValueError, match="is not a subclass of OpenEnv's"):
        adapter.OpenEnvConfig(environment="megamarl.orchestration.envs.openenv_relay:RelayAction")
    with pytest.raises(ValueError, match=r"env.kwargs.text_field='text' is not a field of RelayAction"):
        adapter.OpenEnvConfig(environment=RELAY, text_field="text")
    with pytest.raises(ValueError, match="env.kwargs.roles must name one or more distinct roles"):
        adapter.OpenEnvConfig(environment=RELAY, roles=["a", "a"])
    with pytest.raises(ValueError, match="env.kwargs.environment='nowhere:Env'"):
        adapter.OpenEnvConfig(environment="nowhere:Env")
    module = _ledger_module()
    module.LedgerEnvironment.step.__annotations__.pop("action")
    monkeypatch.setitem(sys.modules, "ledger_env", module)
    with pytest.raises(ValueError, match="does not annotate its action.*set env.kwargs.action"):
        adapter.OpenEnvConfig(environment="ledger_env:LedgerEnvironment")
    config = adapter.OpenEnvConfig(
        environment="ledger_env:LedgerEnvironment", action="ledger_env:LedgerAction"
    )
    assert config.action_class() is module.LedgerAction


def test_missing_package_is_a_load_time_error_naming_the_extra(monkeypatch):
    real = adapter.importlib.util.find_spec
    monkeypatch.setattr(
        adapter.importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a)
    )
    hint = r"needs the 'openenv-core' package.*megamarl\[openenv\].*--extras openenv"
    with pytest.raises(ValueError, match=hint):
        adapter.OpenEnvConfig(environment=RELAY)
