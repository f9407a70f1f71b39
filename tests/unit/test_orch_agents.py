"""Agent configs, the AGENTS registry, plugins, per-agent policy/LoRA/sampling routing."""

import asyncio
import sys

import pytest
from scripted import ScriptedEngine, fixed, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import (
    AGENTS,
    Agent,
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.orchestration.agents import first_choice, sampling_params
from megamarl.registry import import_plugins
from megamarl.rollout.engines.base import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_config_validation_names_keys():
    with pytest.raises(ValueError, match="prompt_template"):
        AgentConfig(policy="default", prompt_template="no placeholder")
    with pytest.raises(ValueError, match="memory_scope"):
        AgentConfig(policy="default", memory_scope="world")
    with pytest.raises(ValueError, match="tree_k"):
        AgentConfig(policy="default", tree_k=0)
    with pytest.raises(ValueError, match=r"agents.<a>.policy must be set"):
        AgentConfig()
    with pytest.raises(ValueError, match=r"agents.<a>.sampling.top_p must be in \(0, 1\], got 5.0"):
        SamplingConfig(top_p=5.0)
    config = AgentConfig(policy="default", sampling={"temperature": 0.5, "max_tokens": 8})
    assert config.sampling == SamplingConfig(temperature=0.5, max_tokens=8)
    assert sampling_params(config.sampling) == SamplingParams(temperature=0.5, max_tokens=8)


def test_allowed_tokens_become_the_policy_tokenizers_ids(tok):
    """``agents.<a>.sampling.allowed_tokens`` (strings in the config) reach the engine as token ids."""
    config = AgentConfig(policy="default", sampling=SamplingConfig(max_tokens=1, allowed_tokens=["A", "B"]))
    ids = (tok.encode("A", add_special_tokens=False)[0], tok.encode("B", add_special_tokens=False)[0])
    assert sampling_params(config.sampling, tok) == SamplingParams(max_tokens=1, allowed_token_ids=ids)
    agent = build_agents({"s": config}, tok, default_kinds={"s": "text"})["s"]
    assert agent.sampling == SamplingParams(
        max_tokens=1, allowed_token_ids=ids, stop_token_ids=(tok.eos_token_id,)
    )
    with pytest.raises(ValueError, match="allowed_tokens: ' hello world' is 2 tokens, not one"):
        sampling_params(
            AgentConfig(policy="default", sampling={"allowed_tokens": [" hello world"]}).sampling, tok
        )


def test_build_agents_errors(tok):
    with pytest.raises(ValueError, match="agents.x.kind"):
        build_agents({"x": AgentConfig(policy="default")}, tok)
    with pytest.raises(ValueError, match="unknown agent agents.x.kind='nope'"):
        build_agents({"x": AgentConfig(policy="default", kind="nope")}, tok)
    with pytest.raises(ValueError, match="no tokenizer"):
        build_agents({"x": AgentConfig(kind="text", policy="p2")}, {"default": tok})
    with pytest.raises(ValueError, match="choices"):
        build_agents({"r": AgentConfig(policy="default", kind="router")}, tok)


def test_eos_is_a_stop_token_and_template_applies(tok):
    agent = build_agents(
        {"s": AgentConfig(policy="default", prompt_template="Q: {observation}")},
        tok,
        default_kinds={"s": "math_solver"},
    )["s"]
    assert tok.eos_token_id in agent.sampling.stop_token_ids
    assert agent.user_message("1+1") == "Q: 1+1" and agent.system == "You are a careful math solver."
    assert agent.response_text(tok.encode("x = 2", add_special_tokens=False) + [tok.eos_token_id]) == "x = 2"


def test_first_choice_parser():
    assert first_choice("Let the answerer go, not the searcher", ("searcher", "answerer")) == (
        "answerer",
        True,
    )
    assert first_choice("nobody", ("searcher",)) == (None, False)


def test_plugin_registration_and_failing_import(tmp_path, monkeypatch):
    (tmp_path / "my_agents_plugin.py").write_text(
        "from megamarl.orchestration import AGENTS, Agent\n"
        "@AGENTS.register('shouter')\nclass Shouter(Agent):\n    def parse(self, text):\n        return "
        "text.upper(), True\n"
    )
    (tmp_path / "broken_plugin.py").write_text("import does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_plugins(["my_agents_plugin"])
    assert "shouter" in AGENTS
    with pytest.raises(ImportError, match="broken_plugin"):
        import_plugins(["broken_plugin"])
    with pytest.raises(ValueError, match="already registered"):
        AGENTS.add("shouter", Agent)
    sys.modules.pop("my_agents_plugin", None)


def test_policies_lora_and_sampling_route_per_agent(tok):
    """L1/L2/L3 mixes: each agent calls its own policy's engine with its adapter and sampling."""
    maker = EnvMaker("math", kinds=("add1",))
    configs = {
        "solver": AgentConfig(
            policy="base", lora="solver_adapter", sampling=SamplingConfig(temperature=0.7, max_tokens=16)
        ),
        "verifier": AgentConfig(policy="big", sampling=SamplingConfig(temperature=0.0, max_tokens=4)),
    }
    agents = build_agents(configs, {"base": tok, "big": tok}, default_kinds=maker.default_agents)
    base, big = (
        ScriptedEngine(tok, fixed("4"), weight_version=3),
        ScriptedEngine(tok, fixed("yes"), weight_version=9),
    )
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify"),
            maker,
            maker.tasks(1),
            agents=agents,
            engines={"base": base, "big": big},
        )
    )
    ((_, s_sampling, s_lora),) = base.requests
    ((_, v_sampling, v_lora),) = big.requests
    assert (s_lora, s_sampling.temperature, s_sampling.max_tokens) == ("solver_adapter", 0.7, 16)
    assert (v_lora, v_sampling.temperature) == (None, 0.0)
    assert [(s.agent, s.policy, s.weight_version) for s in result.samples] == [
        ("solver", "base", 3),
        ("verifier", "big", 9),
    ]
    assert all(len(s.rollout_logprobs) == len(s.response_ids) for s in result.samples)


def test_stop_strings_and_max_tokens_reach_the_engine_and_cut_the_reply(tok):
    """``agents.<a>.sampling.stop`` / ``max_tokens``: carried by every request of the agent; the
    parser reads the reply cut before the first stop string (the ids keep every sampled token)."""
    maker = EnvMaker("math", kinds=("add1",))
    configs = {
        "solver": AgentConfig(policy="default", sampling={"max_tokens": 7, "stop": ["</answer>", "\n\n"]}),
        "verifier": AgentConfig(policy="default", sampling={"max_tokens": 3}),
    }
    agents = build_agents(configs, tok, default_kinds=maker.default_agents)
    engine = ScriptedEngine(tok, fixed("4"))
    asyncio.run(
        run_episodes(
            build_orchestra("solve_verify"), maker, maker.tasks(1), agents=agents, engines={"default": engine}
        )
    )
    (_, solver, _), (_, verifier, _) = engine.requests[:2]  # solver first, then the verifier
    assert (solver.stop, solver.max_tokens) == (("</answer>", "\n\n"), 7)
    assert (verifier.stop, verifier.max_tokens) == ((), 3)
    agent = agents["solver"]
    ids = tok.encode("<answer>4</answer> more\n\nrest", add_special_tokens=False)
    assert agent.response_text(ids) == "<answer>4"
    assert agent.response_text(tok.encode("a\n\nb</answer>", add_special_tokens=False)) == "a"
    with pytest.raises(ValueError, match=r"agents.<a>.sampling.stop must list non-empty strings"):
        SamplingConfig(stop=[""])
