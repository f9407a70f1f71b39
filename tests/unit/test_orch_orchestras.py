"""Built-in orchestras with scripted policies: who acts when, active mask, memory, tree sampling."""

import asyncio
from dataclasses import dataclass

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import (
    ENVS,
    AgentConfig,
    ConfigError,
    Env,
    EnvConfig,
    EnvMaker,
    StepResult,
    Task,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.orchestration.orchestras import topological_levels


@dataclass
class LogConfig(EnvConfig):
    roles: tuple[str, ...] = ("a", "b", "c")
    done_after: int = 99  # env steps before done


@ENVS.register("testing_log")
class LogEnv(Env):
    """Records (agent, text) of each step; done after ``done_after`` steps; team reward = #steps."""

    Config = LogConfig

    def __init__(self, task, config):
        super().__init__(task, config)
        self.agents = tuple(config.roles)
        self.log: list[tuple[str, str]] = []

    @classmethod
    def generate_tasks(cls, config, *, num_tasks, seed):
        return [Task(f"log-{i}", i) for i in range(num_tasks)]

    def observe(self, agent):
        return f"obs for {agent} after {len(self.log)}"

    def step(self, agent, action):
        self.log.append((agent, action.text))
        self.done = len(self.log) >= self.config.done_after
        return StepResult(local_reward=float(len(self.log)))

    def team_reward(self):
        return float(len(self.log))

    def score(self, agent, action):
        return float(len(action.text))  # longest candidate wins


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _run(
    tok, orchestra, policy, *, roles=("a", "b", "c"), configs=None, done_after=99, num_tasks=1, group_size=1
):
    maker = EnvMaker("testing_log", roles=roles, done_after=done_after)
    configs = configs or {r: AgentConfig(policy="default", kind="text") for r in roles}
    engine = ScriptedEngine(tok, policy)
    agents = build_agents(configs, tok)
    envs = []

    def make(task):
        envs.append(maker(task))
        return envs[-1]

    result = asyncio.run(
        run_episodes(
            orchestra,
            make,
            maker.tasks(num_tasks),
            agents=agents,
            engines={"default": engine},
            group_size=group_size,
        )
    )
    return result, envs, engine


def _who(request):  # reply with the agent named in the observation
    return request.last_user.split()[2]


def test_sequential_cycles_order_until_budget(tok):
    result, (env,), _ = _run(tok, build_orchestra("sequential", order=("b", "a"), max_steps=5), _who)
    assert [a for a, _ in env.log] == ["b", "a", "b", "a", "b"]
    assert [(s.agent, s.turn, s.step) for s in result.samples] == [
        ("b", 0, 0),
        ("a", 0, 1),
        ("b", 1, 2),
        ("a", 1, 3),
        ("b", 2, 4),
    ]
    assert [s.local_reward for s in result.samples] == [1, 2, 3, 4, 5]
    assert all(s.team_reward == 5.0 for s in result.samples)
    assert result.episodes[0].num_calls == {"a": 2, "b": 3} and not result.episodes[0].env_done


def test_done_episode_stops_calling_agents(tok):
    result, (env,), engine = _run(tok, build_orchestra("sequential", max_steps=50), _who, done_after=2)
    assert len(env.log) == 2 and len(engine.requests) == 2 and result.episodes[0].env_done


def test_router_routes_by_parsed_reply(tok):
    replies = iter(["send b", "hi from b", "now c please", "hi from c", "nobody"])
    configs = {
        "r": AgentConfig(policy="default", kind="router", choices=("b", "c")),
        "b": AgentConfig(policy="default", kind="text"),
        "c": AgentConfig(policy="default", kind="text"),
    }
    result, (env,), _ = _run(
        tok,
        build_orchestra("router", router="r", max_hops=5),
        lambda q: next(replies),
        roles=("r", "b", "c"),
        configs=configs,
    )
    assert [a for a, _ in env.log] == ["r", "b", "r", "c", "r"]
    assert [s.valid for s in result.samples] == [True, True, True, True, False]  # "nobody" is invalid


def test_solve_verify_exits_on_approval(tok):
    replies = iter(["x", "no", "y", "yes", "never"])
    configs = {
        "s": AgentConfig(policy="default", kind="text"),
        "v": AgentConfig(policy="default", kind="math_verifier"),
    }
    _result, (env,), _ = _run(
        tok,
        build_orchestra("solve_verify", solver="s", verifier="v", max_loops=5, approve_value=True),
        lambda q: next(replies),
        roles=("s", "v"),
        configs=configs,
    )
    assert env.log == [("s", "x"), ("v", "no"), ("s", "y"), ("v", "yes")]


def test_solve_verify_respects_loop_budget(tok):
    configs = {
        "s": AgentConfig(policy="default", kind="text"),
        "v": AgentConfig(policy="default", kind="math_verifier"),
    }
    _, (env,), _ = _run(
        tok,
        build_orchestra("solve_verify", solver="s", verifier="v", max_loops=2, approve_value=True),
        lambda q: "no",
        roles=("s", "v"),
        configs=configs,
    )
    assert len(env.log) == 4


def test_dag_levels_run_concurrently_and_read_inputs(tok):
    seen = {}

    def policy(request):
        agent = request.last_user.split()[2]
        seen[agent] = request.last_user
        return f"out-{agent}"

    nodes = {"a": (), "b": (), "c": ("a", "b")}
    _, (env,), _engine = _run(tok, build_orchestra("dag", nodes=nodes), policy)
    assert env.log == [("a", "out-a"), ("b", "out-b"), ("c", "out-c")]
    assert "Inputs:\n[a] out-a\n[b] out-b" in seen["c"]
    assert topological_levels(nodes) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match="cycle"):
        build_orchestra("dag", nodes={"a": ("b",), "b": ("a",)})


def test_simultaneous_round(tok):
    result, (env,), _ = _run(tok, build_orchestra("simultaneous", max_rounds=2), _who, roles=("a", "b"))
    assert [a for a, _ in env.log] == ["a", "b", "a", "b"]
    assert [(s.agent, s.turn) for s in result.samples] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_tree_sampling_keeps_k_branches_and_continues_from_best(tok):
    configs = {"a": AgentConfig(policy="default", kind="text", tree_k=3)}
    result, (env,), engine = _run(
        tok,
        build_orchestra("sequential", max_steps=2),
        lambda q: "x" * (q.index + 1) if q.index != 1 else "yyyyyy",
        roles=("a",),
        configs=configs,
    )
    assert [(s.turn, s.branch) for s in result.samples] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert env.log == [("a", "yyyyyy"), ("a", "yyyyyy")]  # branch 1 is the longest
    assert [s.local_reward for s in result.samples[:3]] == [1.0, 6.0, 3.0]  # candidate scores
    assert engine.requests[0][1].n == 3 and len(engine.requests) == 2


def test_memory_drops_oldest_turns_to_fit_budget(tok):
    configs = {"a": AgentConfig(policy="default", kind="text", memory_tokens=7, memory_scope="team")}
    seen = []

    def policy(request):
        seen.append(request.last_user)
        return f"word{len(seen)} alpha"

    _run(tok, build_orchestra("sequential", max_steps=4), policy, roles=("a",), configs=configs)
    assert "Earlier turns" not in seen[0]
    assert len(tok.encode("word1 alpha")) == 3  # so a 7-token budget holds the two newest entries
    assert "[a] word1 alpha\n[a] word2 alpha" in seen[2]
    assert "[a] word2 alpha\n[a] word3 alpha" in seen[3] and "word1" not in seen[3]


def test_missing_engine_or_agent_is_a_config_error(tok):
    maker = EnvMaker("testing_log", roles=("a",))
    agents = build_agents({"a": AgentConfig(kind="text", policy="other")}, tok)
    with pytest.raises(ConfigError, match="no engine"):
        asyncio.run(
            run_episodes(build_orchestra("sequential"), maker, maker.tasks(1), agents=agents, engines={})
        )


def test_prompt_too_long_drops_episode(tok):
    configs = {"a": AgentConfig(policy="default", kind="text", max_prompt_tokens=5)}
    result, _, _ = _run(tok, build_orchestra("sequential"), _who, roles=("a",), configs=configs, num_tasks=2)
    assert result.num_dropped == 2 and result.reasons() == {"prompt_too_long": 2} and result.samples == []


def test_group_size_and_episode_ids(tok):
    result, _, _ = _run(
        tok, build_orchestra("sequential", max_steps=1), _who, roles=("a",), num_tasks=2, group_size=3
    )
    assert [e.episode_id for e in result.episodes] == [
        "log-0/0",
        "log-0/1",
        "log-0/2",
        "log-1/0",
        "log-1/1",
        "log-1/2",
    ]
    assert [s.task_id for s in result.samples] == ["log-0"] * 3 + ["log-1"] * 3


def test_external_roles_take_the_pass_through_kind_at_load_and_in_the_run():
    """An external program's replies are its own: every role it calls defaults to the ``text`` kind
    (any non-empty reply valid, unparsed), over the env's kinds, whose parsers marked a critic's
    "OK"/"REVISE" invalid; a role the env does not know needs no ``agents.<role>.kind`` either. One
    answer (``default_kinds``) for the load-time check and the driver's agents."""
    from pathlib import Path

    from megamarl.cli.configure import load_config
    from megamarl.orchestration.orchestras import default_kinds

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "examples" / "openai_team" / "openai_team.yaml",
        ["orchestra.kwargs.roles=[solver,verifier,critic]", "+agents.critic={policy: shared}"],
    )  # before: "agents.critic.kind is empty and env 'math' has no default kind for role 'critic'"
    external = build_orchestra(cfg.orchestra.name, **cfg.orchestra.kwargs)
    maker = EnvMaker("math")
    kinds = default_kinds(external, maker.agents, maker.default_agents)
    assert kinds == {"solver": "text", "verifier": "text", "critic": "text"}
    agents = build_agents(cfg.agents, smollm2_tokenizer(), default_kinds=kinds)
    assert agents["verifier"].parse(" REVISE: check the sum ") == ("REVISE: check the sum", True)
    # an orchestra of its own agents keeps the env's kinds
    assert default_kinds(build_orchestra("solve_verify"), maker.agents, maker.default_agents) == {
        "solver": "math_solver",
        "verifier": "math_verifier",
    }
