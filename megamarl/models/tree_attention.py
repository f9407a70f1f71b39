"""Prefix-tree core attention with torch's flex attention: megatron-core's core-attention call
(``query, key, value, attention_mask, *, attn_mask_type, attention_bias, packed_seq_params``), where
``attention_mask`` carries the tree's subtree ends ``[1, N]`` (``rl.tree.TreeBatch.subtree_ends``)
instead of a dense ``[1, 1, N, N]`` mask.

The nodes are laid out in DFS preorder, so node n sees node m (m is n or an ancestor of n) iff
``m <= n < ends[m]``: an O(N) ``mask_mod``, and a block-sparse ``BlockMask`` built from the same
intervals at block level (``tree_block_mask``), so no ``N x N`` tensor exists. ``layer_spec`` puts
``FlexTreeAttention`` in place of the spec's core attention (TE's or the local one) and keeps every
linear layer. On CUDA flex attention runs compiled (``torch.compile``); on a CPU it runs eagerly,
forward only: torch 2.13 refuses flex attention's backward on CPU. Why flex rather than a varlen
prefix/suffix split, and the block-level argument: docs/design-notes.md, "Flex tree attention".
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK_SIZE = 128  # flex attention's default tile (rows and columns); the block mask counts in these
BLOCK_MASK_INDEX_BYTES = 4  # int32 block counts and indices


def tree_block_mask(ends: Tensor, *, block_size: int = BLOCK_SIZE) -> BlockMask:
    """The ``BlockMask`` of ancestor-or-self attention over a preorder layout with subtree ends
    ``ends`` [N]. For query block Q = [qs, qe) and key block K: K after Q holds no visible pair; K = Q
    always does (the diagonal); K before Q has one iff ``max(ends[K]) > qs`` and all pairs visible
    ("full", the mask_mod skipped) iff ``min(ends[K]) >= qe`` and Q has no padding rows."""
    num = ends.numel()
    num_blocks = _num_blocks(num, block_size)
    padded = num_blocks * block_size
    device = ends.device
    # padding columns end at 0: visible to no query, so the mask_mod may index them safely
    ends_padded = torch.zeros(padded, dtype=torch.long, device=device)
    ends_padded[:num] = ends
    column = torch.arange(padded, device=device)
    max_end = ends_padded.view(num_blocks, block_size).amax(dim=1)
    min_end = torch.where(column < num, ends_padded, padded + 1).view(num_blocks, block_size).amin(dim=1)
    blocks = torch.arange(num_blocks, device=device)
    q_start = blocks * block_size
    q_stop = torch.clamp((blocks + 1) * block_size, max=num)
    before = blocks[None, :] < blocks[:, None]  # [q block, kv block]
    touched = (blocks[None, :] == blocks[:, None]) | (before & (max_end[None, :] > q_start[:, None]))
    full = before & (min_end[None, :] >= q_stop[:, None]) & (q_stop - q_start == block_size)[:, None]
    partial = touched & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends_padded[kv_idx])

    def as_blocks(keep: Tensor) -> tuple[Tensor, Tensor]:  # [nq, nkv] bool -> counts, indices first
        counts = keep.sum(dim=1, dtype=torch.int32)
        indices = torch.argsort((~keep).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    kv_num, kv_indices = as_blocks(partial)
    full_num, full_indices = as_blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(num, num),
    )


def block_mask_bytes(num_tokens: int, *, block_size: int = BLOCK_SIZE) -> int:
    """Bytes a ``tree_block_mask`` of ``num_tokens`` nodes holds: the padded ends (int64) and eight
    int32 tensors, block counts [nb] and indices [nb, nb] for partial and full blocks, by key block
    and (for the backward) by query block; nb = ceil(N / block_size). What one micro-batch keeps."""
    num_blocks = _num_blocks(num_tokens, block_size)
    return 8 * num_blocks * block_size + 4 * BLOCK_MASK_INDEX_BYTES * (num_blocks + num_blocks**2)


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return max(1, -(-num_tokens // block_size))


@functools.cache
def _compiled_flex():
    # fused kernels on CUDA; the first call per shape compiles, later shapes compile once as dynamic
    return torch.compile(flex_attention)


def _block_mask(ends: Tensor) -> BlockMask:
    """``tree_block_mask`` of ``ends``, built once per micro-batch: every layer receives the same
    ``ends`` tensor, which carries its mask (a recomputed layer in backward may get another tensor
    object and rebuilds it)."""
    cached = getattr(ends, "_tree_block_mask", None)
    if cached is None:
        cached = tree_block_mask(ends.view(-1))
        ends._tree_block_mask = cached  # type: ignore[attr-defined]  # lives and dies with the tensor
    return cached


class FlexTreeAttention(torch.nn.Module):
    """Core attention over a prefix-tree layout (one row of N nodes), megatron-core's call signature.
    Heads are this TP rank's (the shapes of ``query`` [N, 1, heads, d] and ``key``/``value``
    [N, 1, groups, d]; GQA through ``enable_gqa``); softmax scale ``1/sqrt(kv_channels)`` unless given,
    as in megatron-core's and TE's attention; no dropout."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attention_dropout": dropout,
            "context_parallel_size": config.context_parallel_size != 1,
            "window_size": config.window_size is not None,
            "softmax_type": config.softmax_type != "vanilla",
        }
        bad = [key for key, value in unsupported.items() if value]
        if bad:
            raise ValueError(f"flex tree attention supports no {bad} (TransformerConfig)")
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: Tensor,  # [N, 1, heads, d]
        key: Tensor,  # [N, 1, groups, d]
        value: Tensor,
        attention_mask: Tensor | None,  # [1, N] long: the subtree ends
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:  # [N, 1, heads * d]
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("flex tree attention takes no attention_bias and no packed_seq_params")
        if attention_mask is None or attention_mask.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                "flex tree attention takes the tree's subtree ends [1, N] (TreeBatch.subtree_ends()) as the "
                f"attention mask, got {None if attention_mask is None else attention_mask.dtype}"
            )
        num, rows = query.shape[0], query.shape[1]
        if rows != 1 or attention_mask.numel() != num:
            raise ValueError(
                f"flex tree attention: one row of {attention_mask.numel()} nodes, got {rows} x {num}"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [1, heads, N, d]
        attend = _compiled_flex() if query.is_cuda else flex_attention
        out = attend(
            q,
            k,
            v,
            block_mask=_block_mask(attention_mask),
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(num, rows, -1)
