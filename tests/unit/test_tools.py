"""Tools: tool-call parsing (Hermes/Qwen blocks, Llama JSON), the calculator, tool prompts, and an
agent with tools on the math env: the reply that calls the calculator is answered with its result as
the next (tool) turn, token-exact, and both samples share the episode's rewards."""

import asyncio
import json

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer

from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.orchestration.chat import ChatTranscript
from megamarl.orchestration.tools import (
    TOOLS,
    Tool,
    ToolCall,
    calculator,
    call_tool,
    forced_call,
    parse_tool_calls,
    with_tools,
)


def test_parse_hermes_blocks_with_text_around():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call> ok'
    )
    content, calls = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "3*4"})] and content == "Let me compute.  ok"
    two = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert [c.name for c in parse_tool_calls(two)[1]] == ["a", "b"] and parse_tool_calls(two)[1][
        0
    ].arguments == {"x": 1}


def test_parse_llama_json_and_non_calls():
    assert parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}') == (
        "",
        [ToolCall("calculator", {"expression": "1+1"})],
    )
    assert (
        parse_tool_calls('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]')[1][1].name
        == "b"
    )
    for text in ("The answer is 5", '{"answer": 5}', "<tool_call>not json</tool_call>", "{broken"):
        assert parse_tool_calls(text) == (text, [])


def test_calculator_and_run_tool_errors():
    assert calculator("12 * (3 + 4)") == "84" and calculator("7 / 2") == "3.5" and calculator("3 x 4") == "12"
    tools = {"calculator": TOOLS.get("calculator")}
    assert call_tool(ToolCall("calculator", {"expression": "2**10"}), tools) == "1024"
    assert call_tool(ToolCall("calculator", {"expression": "__import__('os')"}), tools).startswith(
        "error: ValueError"
    )
    assert call_tool(ToolCall("calculator", {"expr": "1"}), tools).startswith("error: TypeError")
    assert call_tool(ToolCall("search", {}), tools) == "error: unknown tool 'search'; tools: ['calculator']"
    with pytest.raises(ValueError, match="exponent too large"):
        calculator("2 ** 1000")


def test_tools_reach_the_prompt_with_and_without_template_support():
    tokenizer = smollm2_tokenizer()  # its ChatML template ignores tools: the schemas go into the system turn
    schema = TOOLS.get("calculator").schema()
    messages, kwargs = with_tools([{"role": "user", "content": "q"}], [schema], tokenizer)
    assert (
        kwargs == {} and messages[0]["role"] == "system" and '"name": "calculator"' in messages[0]["content"]
    )

    class Native:
        chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"

    assert with_tools([{"role": "user", "content": "q"}], [schema], Native())[1] == {"tools": [schema]}
    transcript = ChatTranscript(tokenizer, "Be brief.", tools=[schema])
    transcript.add_user("What is 3 x 4?")
    text = tokenizer.decode(transcript.ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions") and "<tools>" in text


def test_math_solver_calls_the_calculator():
    tokenizer = smollm2_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'

    def policy(request):
        if "<|im_start|>tool\n" in request.prompt_text:  # the result is the last turn: answer with it
            return f"The answer is {request.prompt_text.rsplit('<|im_start|>tool', 1)[1].split()[0]}"
        question = request.last_user.splitlines()[0].removeprefix("What is ").rstrip("?")
        return call % question

    engine = ScriptedEngine(tokenizer, policy)
    maker = EnvMaker("math", with_verifier=False, kinds=["mul12"])
    configs = {
        "solver": AgentConfig(policy="p", tools=["calculator"], sampling=SamplingConfig(max_tokens=64))
    }
    agents = build_agents(configs, tokenizer, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential"), maker, maker.tasks(3, seed=0), agents=agents, engines={"p": engine}
        )
    )
    assert result.num_failed == 0 and len(result.samples) == 6
    for episode in result.episodes:
        assert episode.team_reward == 1.0 and episode.success
    for first, second in zip(result.samples[::2], result.samples[1::2]):
        assert (first.turn, second.turn) == (0, 1) and "<tool_call>" in first.response_text
        # token-exact: the second prompt extends the first prompt and the sampled call verbatim
        assert (
            second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)]
            == first.prompt_ids + first.response_ids
        )
        assert (
            first.team_reward == second.team_reward == 1.0
            and first.local_reward == second.local_reward == 1.0
        )
        assert first.valid and second.valid
    assert [(e.tool_calls, e.tool_errors) for e in result.episodes] == [({"solver": 1}, {"solver": 0})] * 3
    summary = result.summary()
    assert (summary["agent/solver/tool_calls"], summary["agent/solver/tool_errors"]) == (3.0, 0.0)
    json.dumps([s.response_text for s in result.samples])


def test_tools_are_validated_naming_the_key():
    with pytest.raises(ValueError, match="agents.<a>.tools cannot be combined with agents.<a>.tree_k"):
        AgentConfig(policy="p", tools=["calculator"], tree_k=2)
    with pytest.raises(ValueError, match="agents.solver.tools"):
        build_agents(
            {"solver": AgentConfig(policy="p", tools=["abacus"])},
            smollm2_tokenizer(),
            default_kinds={"solver": "math_solver"},
        )


@pytest.mark.parametrize("name", TOOLS.names())
def test_registered_tools_have_an_object_schema_and_a_function(name):
    tool = TOOLS.get(name)
    assert tool.name == name and callable(tool.fn)
    schema = tool.schema()
    assert schema["type"] == "function" and schema["function"]["parameters"]["type"] == "object"


def test_a_failing_tool_call_is_counted_and_answered_with_the_error():
    tokenizer = smollm2_tokenizer()
    seen = []

    def policy(request):
        if "<|im_start|>tool\n" in request.prompt_text:
            seen.append(request.prompt_text)
            return "The answer is 0"
        return (
            '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*"}}</tool_call>'
        )

    maker = EnvMaker("math", with_verifier=False, kinds=["mul12"])
    configs = {
        "solver": AgentConfig(policy="p", tools=["calculator"], sampling=SamplingConfig(max_tokens=64))
    }
    agents = build_agents(configs, tokenizer, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential"),
            maker,
            maker.tasks(2, seed=0),
            agents=agents,
            engines={"p": ScriptedEngine(tokenizer, policy)},
        )
    )
    assert result.num_failed == 0
    summary = result.summary()
    assert (summary["agent/solver/tool_calls"], summary["agent/solver/tool_errors"]) == (4.0, 4.0)
    # both results, each its own tool turn, then one generation prompt (two prompts broke the template delta)
    assert seen[0].endswith(
        "<|im_start|>tool\nerror: unknown tool 'abacus'; tools: ['calculator']<|im_end|>\n"
        "<|im_start|>tool\nerror: SyntaxError: invalid syntax (<unknown>, line 1)<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("multi_turn", [False, True])
def test_tool_choice_opens_the_reply_with_the_named_call(multi_turn):
    """agents.<a>.tool_choice=calculator: the first reply's prompt ends with the call's opening (prompt
    tokens, not trained); the model writes only the arguments; the tool runs; the next reply is free."""
    tokenizer = smollm2_tokenizer()
    prefix = '<tool_call>{"name": "calculator", "arguments": {"expression": "'

    def policy(request):
        if "<|im_start|>tool\n" in request.prompt_text:
            return f"The answer is {request.prompt_text.rsplit('<|im_start|>tool', 1)[1].split()[0]}"
        assert request.prompt_text.endswith("<|im_start|>assistant\n" + prefix)
        question = request.prompt_text.rsplit("What is ", 1)[1].split("?")[0]
        return question + '"}} and more'  # the reply ends at its first quote (a stop string)

    maker = EnvMaker("math", with_verifier=False, kinds=["mul12"])
    configs = {
        "solver": AgentConfig(
            policy="p",
            tools=["calculator"],
            tool_choice="calculator",
            multi_turn=multi_turn,
            sampling=SamplingConfig(max_tokens=64),
        )
    }
    agents = build_agents(configs, tokenizer, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential"),
            maker,
            maker.tasks(2, seed=0),
            agents=agents,
            engines={"p": ScriptedEngine(tokenizer, policy)},
        )
    )
    assert result.num_failed == 0 and all(e.team_reward == 1.0 for e in result.episodes)
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    for call, answer in zip(result.samples[::2], result.samples[1::2]):
        assert call.prompt_ids[-len(prefix_ids) :] == prefix_ids  # the opening: prompt tokens, not trained
        assert call.response_text == tokenizer.decode(call.response_ids).split('"')[0]  # the expression alone
        # token-exact: the answer's prompt extends the call's prompt (opening included) and its reply
        assert (
            answer.prompt_ids[: len(call.prompt_ids) + len(call.response_ids)]
            == call.prompt_ids + call.response_ids
        )
    assert result.summary()["agent/solver/tool_calls"] == 2.0


def test_forced_call_writes_one_string_argument_or_the_arguments_object():
    calc = forced_call("calculator", TOOLS.get("calculator").parameters)
    assert (calc.argument, calc.stop) == ("expression", ('"',))
    assert calc.opening == '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    assert calc.calls("1 + 2}}</tool_call>") == [
        ToolCall("calculator", {"expression": "1 + 2}}</tool_call>"})
    ]
    text = calc.turn_text("2 \\ 3")  # whatever the reply holds, the call is well-formed
    assert text.startswith(calc.opening) and parse_tool_calls(text)[1] == [
        ToolCall("calculator", {"expression": "2 \\ 3"})
    ]
    two = Tool(
        "move",
        "Move.",
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
        fn=dict,
    )
    move = forced_call(two.name, two.parameters)
    assert (move.argument, move.stop, move.opening) == (None, (), '<tool_call>{"name": "move", "arguments": ')
    assert parse_tool_calls(move.turn_text('{"x": 1, "y": 2}}</tool_call>'))[1] == [
        ToolCall("move", {"x": 1, "y": 2})
    ]
