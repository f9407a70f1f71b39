"""The GPU tier (docs/gpu.md; ``scripts/gpu_check.sh`` runs it): every test is ``pytest.mark.gpu`` and
skips without CUDA (here and in ``tests/conftest.py``), except the kit's own checks (``gpu_kit``:
what the tier imports imports), which run anywhere; modules import no CUDA and no packaged model,
so the tier collects on any machine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip(
            "needs CUDA (torch.cuda.is_available() is False); run it on a GPU node: bash scripts/gpu_check.sh"
        )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama (GQA, tied embeddings) without a tokenizer: an HF directory."""
    from gpu_common import save_tiny_random

    return save_tiny_random(tmp_path_factory.mktemp("gpu_models") / "tiny_llama", "llama", seed=0)
