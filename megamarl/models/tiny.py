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


def tiny_config(family: str = "llama", *, vocab_size: int = 49152, **overrides):
    """A transformers config for ``family`` in {llama, qwen2, qwen3} at test size."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = dict(TINY_DEFAULTS, vocab_size=vocab_size, **overrides)
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
    raise ValueError(f"tiny model family '{family}' unknown; allowed: llama, qwen2, qwen3")


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
