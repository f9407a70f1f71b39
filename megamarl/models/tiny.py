"""Tiny random models for fast tests: real HF architectures, a few layers, no download.

``megamarl.models.packaged.save_tiny_model`` writes one with the packaged SmolLM2 tokenizer (so prompts, chat
templates and EOS behave like the real model) and differ per family only in what the family tests must
exercise: GQA, QKV bias, tied/untied embeddings, QK-norm.
"""

from __future__ import annotations

import torch

TINY_DEFAULTS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


# MoE families at test size: 8 experts of intermediate size 32, top-2 (``tiny_config``'s MoE defaults)
TINY_MOE_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def tiny_config(family: str = "llama", *, vocab_size: int = 49152, **overrides):
    """A transformers config for ``family`` in {llama, qwen2, qwen3, qwen2_moe, qwen3_moe} at test size.
    The MoE ones: Qwen3-MoE with ``norm_topk_prob`` and layer 1 dense (``mlp_only_layers``), Qwen2-MoE with
    a shared expert of intermediate size 48 and top-k probabilities not renormalised."""
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    kwargs = dict(TINY_DEFAULTS, vocab_size=vocab_size, **overrides)
    if family == "qwen3_moe":
        kwargs = {**TINY_MOE_DEFAULTS, "norm_topk_prob": True, "mlp_only_layers": [1], **kwargs}
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        return Qwen3MoeConfig(**kwargs)
    if family == "qwen2_moe":
        shared = {"norm_topk_prob": False, "shared_expert_intermediate_size": 48}
        kwargs = {**TINY_MOE_DEFAULTS, **shared, **kwargs}
        kwargs.setdefault("tie_word_embeddings", False)
        return Qwen2MoeConfig(**kwargs)
    if family == "llama":
        kwargs.setdefault("tie_word_embeddings", True)
        return LlamaConfig(**kwargs)
    if family == "qwen2":
        kwargs.setdefault("tie_word_embeddings", False)
        return Qwen2Config(**kwargs)
    if family == "qwen3":
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        return Qwen3Config(**kwargs)
    raise ValueError(
        f"tiny model family '{family}' unknown; allowed: llama, qwen2, qwen3, qwen2_moe, qwen3_moe"
    )


def tiny_model(family: str = "llama", *, seed: int = 0, init_std: float | None = 0.15, **overrides):
    """A randomly initialised fp32 ``*ForCausalLM`` (deterministic for a seed).

    ``init_std=None`` keeps HF's own initialisation (std 0.02: near-uniform outputs, the usual start
    for training from scratch, e.g. the learning tests)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises with std 0.02: logits are nearly flat. A larger std gives peaked, seed-specific
    # distributions, which makes greedy decoding and logit-equality tests meaningful.
    if init_std is None:
        return model.eval()
    with torch.no_grad():
        for _name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, init_std)
    return model.eval()


# A model trained from scratch knows no chat format; this template only joins turns with newlines
# and adds no generation prompt, so the last prompt token is the observation's own last token.
PLAIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ m['content'] }}{{ '' if m['role'] == 'user' else '\n' }}{%- endfor -%}"
)


# Lines the tiny Qwen2 tokenizer's merges are learnt from: enough English, digits and letters for 256
# merges, so its vocabulary is 512 byte-level BPE tokens and its specials follow (as in Qwen2).
_BPE_CORPUS = (
    "You are a helpful assistant. Answer the question and give the final answer as a number.",
    (
        "The sender sees a secret digit and sends one letter; "
        "the receiver sees only the letter and names the digit."
    ),
    "Solve the problem step by step, then check the solution before you reply with the answer.",
    "Question: what is 12 + 7? Answer: 19. Question: what is 3 x 4? Answer: 12. Question: 8 - 5? Answer: 3.",
    "The verifier reviews the solver's answer: reply APPROVE when it is correct and REJECT when it is not.",
    "Search the documents for the title, read the passage and write the answer in a few words.",
    "Player one moves first; the board has three rows and three columns, and a line of three wins the game.",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) , . : ; ? !",
)
# Qwen2's ChatML template (its default system turn included), reduced to plain turns.
QWEN2_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tiny_qwen2_tokenizer(*, num_regular: int = 512):
    """A Qwen2 tokenizer of its own, deterministic and offline: byte-level BPE with Qwen2's normalizer
    and pre-tokenizer, its merges learnt here from ``_BPE_CORPUS`` (``num_regular`` ids), then Qwen2's
    specials ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and its ChatML template.
    Unlike SmolLM2's (49152 ids, pad = eos = 2), so one run can hold two tokenizer families."""
    import json

    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=num_regular, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_BPE_CORPUS, trainer=trainer)
    learnt = json.loads(bpe.to_str())["model"]
    if len(learnt["vocab"]) != num_regular:
        raise ValueError(
            f"tiny_qwen2_tokenizer: the corpus gives {len(learnt['vocab'])} tokens, not {num_regular}"
        )
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    vocab = {**learnt["vocab"], **{token: num_regular + i for i, token in enumerate(specials)}}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in learnt["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(specials[1:]),
        chat_template=QWEN2_CHAT_TEMPLATE,
    )
