"""Counting what autograd keeps for backward, for the activation-memory tests (CPU and GPU)."""

from __future__ import annotations

import torch


def record_saved_storage(params: set[int], storages: dict[int, int], tensor: torch.Tensor) -> torch.Tensor:
    """saved_tensors_hooks pack: note the storage of a tensor autograd keeps (parameters aside)."""
    storage = tensor.untyped_storage()
    if storage.data_ptr() not in params:
        storages[storage.data_ptr()] = storage.nbytes()
    return tensor
