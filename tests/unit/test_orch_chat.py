"""Token-exact multi-turn prompts: history ids are never re-tokenized; deltas are checked."""

import asyncio
from typing import ClassVar

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
from megamarl.orchestration.chat import ChatTranscript, TemplateDeltaError


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_transcript_appends_deltas_and_closing(tok):
    chat = ChatTranscript(tok, "SYS")
    chat.add_user("What is 2+2?")
    first = list(chat.ids)
    assert (
        tok.decode(first) == "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nWhat is "
        "2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    reply = tok.encode(" 2 + 2 = 4", add_special_tokens=False) + [tok.eos_token_id]
    tail = chat.add_response(reply, " 2 + 2 = 4")
    assert tail == tok.encode("\n", add_special_tokens=False)  # <|im_end|> was sampled, only "\n" added
    chat.add_user("Sure?")
    assert chat.ids[: len(first)] == first
    assert chat.ids[len(first) : len(first) + len(reply)] == reply  # the sampled ids, verbatim
    assert tok.decode(chat.ids).endswith(
        "<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_truncated_reply_gets_full_closing(tok):
    chat = ChatTranscript(tok, None)
    chat.add_user("hi")
    reply = tok.encode("hello there", add_special_tokens=False)  # no eos: truncated
    assert chat.add_response(reply, "hello there") == [tok.eos_token_id] + tok.encode(
        "\n", add_special_tokens=False
    )


def test_odd_tokenization_is_kept_not_retokenized(tok):
    chat = ChatTranscript(tok, "S")
    chat.add_user("q")
    odd = [tok.convert_tokens_to_ids("4"), tok.convert_tokens_to_ids("2")] + [
        tok.eos_token_id
    ]  # "42" as 2 tokens
    before = len(chat.ids)
    chat.add_response(odd, "42")
    chat.add_user("again")
    assert chat.ids[before : before + 3] == odd


class _RewritingTokenizer:
    """A template that drops earlier assistant turns (like reasoning-stripping templates)."""

    all_special_ids: ClassVar[list[int]] = [0]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i == last_assistant]
        if any(m["role"] == "user" for m in messages[last_assistant + 1 :]) and last_assistant >= 0:
            kept = [m for m in kept if m["role"] != "assistant"]
        return "".join(f"<{m['role']}>{m['content']}</>" for m in kept) + (
            "<assistant>" if add_generation_prompt else ""
        )

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_history_rewriting_template_raises():
    chat = ChatTranscript(_RewritingTokenizer(), None)
    chat.add_user("a")
    chat.add_response([ord("x")], "x")
    with pytest.raises(TemplateDeltaError):
        chat.add_user("b")


def test_multi_turn_samples_are_exactly_what_the_engine_saw(tok):
    replies = iter(["The answer is 7", "no", "Let me redo: 3 + 4 = 8", "yes"])
    engine = ScriptedEngine(tok, lambda request: next(replies))
    maker = EnvMaker("math", kinds=("add1",))
    sampling = SamplingConfig(max_tokens=32)
    agents = build_agents(
        {
            "solver": AgentConfig(policy="default", multi_turn=True, sampling=sampling),
            "verifier": AgentConfig(policy="default", multi_turn=True, sampling=sampling),
        },
        tok,
        default_kinds=maker.default_agents,
    )
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", max_loops=3),
            maker,
            maker.tasks(1, seed=0),
            agents=agents,
            engines={"default": engine},
            max_concurrency=1,
        )
    )
    samples = result.samples
    assert [(s.agent, s.turn, s.step) for s in samples] == [
        ("solver", 0, 0),
        ("verifier", 0, 1),
        ("solver", 1, 2),
        ("verifier", 1, 3),
    ]
    for sample, (prompt, _, _), reply in zip(samples, engine.requests, engine.replies):
        assert sample.prompt_ids == prompt and sample.response_ids == reply
    solver0, solver1 = samples[0], samples[2]
    # the second solver prompt extends the first prompt + the first reply token-for-token
    prefix = solver0.prompt_ids + solver0.response_ids
    assert solver1.prompt_ids[: len(prefix)] == prefix
    assert "A reviewer rejected your previous answer: 7" in tok.decode(solver1.prompt_ids[len(prefix) :])
