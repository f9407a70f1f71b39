"""The conversion CLI's ``main`` (``megamarl-convert``, ``python -m megamarl.cli.export``): HF -> Megatron
torch_dist (saved at TP=2 x PP=2, 4 ranks) -> HF (loaded at TP=1 x PP=2) reproduces every tensor bit-exactly,
and the HF model loads. ``main`` runs in this process (its ranks fork from the worker's preloaded fork
server): the command as a subprocess, with its own interpreter and imports per rank, is run by test_export."""

from __future__ import annotations

import pytest

from megamarl.cli.export import main as convert_main

pytestmark = pytest.mark.distributed


def _cli(*args):
    convert_main(list(args))  # SystemExit (a failed conversion) fails the test with the message


def test_convert_cli_roundtrip_bit_exact(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megamarl.models.packaged import save_tiny_model

    src = save_tiny_model(tmp_path / "hf", "qwen3", head_dim=24)
    _cli("--from", "hf", "--to", "megatron", "--tp", "2", "--pp", "2", str(src), str(tmp_path / "mcore"))
    assert (tmp_path / "mcore" / "megatron" / "metadata.json").is_file()
    _cli(
        "--from",
        "megatron",
        "--to",
        "hf",
        "--tp",
        "1",
        "--pp",
        "2",
        str(tmp_path / "mcore"),
        str(tmp_path / "back"),
    )

    original = load_file(str(src / "model.safetensors"))
    back = {}
    for file in sorted((tmp_path / "back").glob("model-*.safetensors")):
        back.update(load_file(str(file)))
    assert back.keys() == original.keys()
    assert [n for n in original if not torch.equal(original[n], back[n])] == []
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32
    )  # index + tokenizer work
    assert (tmp_path / "back" / "tokenizer.json").is_file() and model.config.head_dim == 24
