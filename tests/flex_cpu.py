"""Flex attention's backward on a CPU, for tests only (imported as ``flex_cpu``).

torch 2.13's ``flex_attention`` refuses inputs that require grad on a CPU (``_validate_device``), and
the product never asks it to (``models.spec.tree_attention_choice``: flex on CUDA only). Its eager path
(the higher-order op's dense math, with autograd) is device-agnostic, so with that one refusal lifted a
CPU test checks ``FlexTreeAttention``'s mask_mod, GQA, scale, layout and gradient flow; the GPU tier
(``tests/gpu/test_tree_flex_gpu.py``) checks the compiled kernels. Eager flex evaluates the mask_mod on
every pair and ignores block sparsity: ``tree_block_mask``'s blocks are checked on their own."""

from __future__ import annotations

import contextlib

import torch.nn.attention.flex_attention as flex


@contextlib.contextmanager
def flex_backward_on_cpu():
    original = flex._validate_device

    def validate(query, key, value):
        if query.device.type != "cpu":
            original(query, key, value)

    flex._validate_device = validate
    try:
        yield
    finally:
        flex._validate_device = original
