"""Several tokenizer families in one run: the packaged tiny Qwen2 with a tokenizer of its own
(``tiny-bpe-qwen2``) next to the tiny Llama with SmolLM2's, and a batch of both policies' rows, each
tokenized, stopped and padded by its own tokenizer."""

import pytest
from transformers import AutoConfig, AutoTokenizer

from megamarl.config import AlgorithmConfig
from megamarl.driver.rollout_driver import policy_pad_ids
from megamarl.models.packaged import resolve_model_path
from megamarl.models.tiny import tiny_qwen2_tokenizer
from megamarl.orchestration import AgentConfig, build_agents
from megamarl.orchestration.chat import ChatTranscript
from megamarl.rl.prepare import prepare_rollout
from megamarl.rl.sample import Sample


@pytest.fixture(scope="module")
def tokenizers():
    return {
        "llama_policy": AutoTokenizer.from_pretrained(resolve_model_path("tiny-random-llama")),
        "qwen_policy": AutoTokenizer.from_pretrained(resolve_model_path("tiny-bpe-qwen2")),
    }


def test_tiny_bpe_qwen2_has_a_tokenizer_family_of_its_own(tokenizers):
    qwen, llama = tokenizers["qwen_policy"], tokenizers["llama_policy"]
    assert type(qwen).__name__ == "Qwen2Tokenizer"
    assert (len(qwen), qwen.pad_token, qwen.pad_token_id, qwen.eos_token, qwen.eos_token_id) == (
        515,
        "<|endoftext|>",
        512,
        "<|im_end|>",
        514,
    )
    assert (len(llama), llama.pad_token_id, llama.eos_token_id) == (49152, 2, 2)
    config = AutoConfig.from_pretrained(resolve_model_path("tiny-bpe-qwen2"))
    assert (config.model_type, config.vocab_size, config.eos_token_id, config.pad_token_id) == (
        "qwen2",
        515,
        514,
        512,
    )
    # built in code, the same every time (the model cache may rebuild it on any machine)
    assert tiny_qwen2_tokenizer().get_vocab() == qwen.get_vocab()
    # ChatML, tokenized by its own vocabulary; the signalling game's letters and digits: one token each
    transcript = ChatTranscript(qwen, "receiver")
    ids = transcript.add_user("Your partner sent the letter: C")
    assert ids[0] == 513  # <|im_start|>
    assert qwen.decode(ids) == (
        "<|im_start|>system\nreceiver<|im_end|>\n"
        "<|im_start|>user\nYour partner sent the letter: C<|im_end|>\n<|im_start|>assistant\n"
    )
    assert all(len(qwen.encode(c, add_special_tokens=False)) == 1 for c in "ABCDEFGHIJ0123456789")
    assert max(ids) < len(qwen) and qwen.get_vocab() != llama.get_vocab()


def test_each_agent_stops_on_its_own_policys_eos(tokenizers):
    configs = {
        "sender": AgentConfig(policy="llama_policy"),
        "receiver": AgentConfig(policy="qwen_policy"),
    }
    agents = build_agents(configs, tokenizers, default_kinds={"sender": "text", "receiver": "text"})
    assert agents["sender"].sampling.stop_token_ids == (2,)
    assert agents["receiver"].sampling.stop_token_ids == (514,)
    assert agents["receiver"].response_text([22, 514]) == "7"


def test_a_two_family_batch_pads_each_policys_rows_with_its_own_pad_id(tokenizers):
    """The driver's pad ids (``policy_pad_ids``) through ``prepare_rollout``: the rows each worker group
    trains on hold only ids of its own vocabulary, its padding its own tokenizer's pad id."""
    pads = policy_pad_ids(tokenizers)
    assert pads == {"llama_policy": 2, "qwen_policy": 512}
    samples = []
    for i, (agent, policy, text) in enumerate(
        [
            ("sender", "llama_policy", "digit 7"),
            ("receiver", "qwen_policy", "letter C, please"),
            ("receiver", "qwen_policy", "B"),
        ]
    ):
        tok = tokenizers[policy]
        prompt = ChatTranscript(tok).add_user(text)
        reply = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
        samples.append(
            Sample(
                "t", f"e{i}", agent, policy, 0, prompt_ids=prompt, response_ids=reply, team_reward=float(i)
            )
        )
    batch, _ = prepare_rollout(
        samples, [], AlgorithmConfig(estimator="grpo"), pad_id=pads, num_tasks=1, draw=lambda _: None
    )
    assert batch.pad_ids == pads
    for policy, rows in batch.split_by_policy().items():
        vocab = len(tokenizers[policy])
        assert int(rows.tokens.max()) < vocab, f"{policy}: an id beyond its vocabulary ({vocab})"
        assert set(rows.tokens[~rows.attention_mask].tolist()) <= {pads[policy]}, policy
    qwen_rows = batch.split_by_policy()["qwen_policy"]
    assert (~qwen_rows.attention_mask).any(), "the shorter Qwen row has padding"
