"""Prefix-tree packing for the training forward pass: every token prefix a micro-batch's samples share
is laid out and computed once.

``tree_pack`` merges the rows (a GRPO group's shared prompt, a team's shared turns, a multi-turn
agent's repeated history) into a trie of exact token prefixes and lays its ``N <= sum(lengths)`` nodes
out in DFS preorder: node m's subtree is ``[m, ends[m])``. Attention is ancestor-only, a dense mask
(``TreeBatch.causal_mask``) or ``m <= n < ends[m]`` (``models.tree_attention``); positions are node
depths (``RotaryPositions``). Token ``j`` of sample ``i`` is predicted at its token ``j - 1``'s node;
``TreeBatch.predictions`` lists one row per (sample, column), the output layer runs on those rows
only, and ``tree_logprobs`` / ``place_tree`` put values at each sample's slot. Each sample keeps its
own masks, advantages and logprobs; a shared node's gradient sums its samples' (fp32 order aside).
Details: docs/design-notes.md, "megamarl/rl/tree.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megamarl.models.bridge import unwrap
from megamarl.rl.vocab_parallel import _VocabParallelLogprobEntropy


@dataclass(frozen=True)
class TreePredictions:
    """One row per predicted token: the layout index whose output predicts it, its sample and column
    in the padded [B, T] batch, and the token predicted."""

    positions: Tensor  # [K] long: layout index (node) of token j - 1
    samples: Tensor  # [K] long: row i of the padded batch
    columns: Tensor  # [K] long: column j
    targets: Tensor  # [K] long: tokens[i, j]


@dataclass(frozen=True)
class TreeBatch:
    """One micro-batch as a single row of trie nodes (B samples, N nodes, padded width T)."""

    tokens: Tensor  # [1, N] long: each node's token
    position_ids: Tensor  # [1, N] long: each node's depth
    parents: Tensor  # [N] long: the parent node's layout index, -1 for a root
    ends: Tensor  # [N] long: one past the last node of each node's subtree (preorder: [n, ends[n]))
    node_of: Tensor  # [B, T] long: the node of each real token of the padded batch, -1 in padding
    seq_len: int  # T

    @property
    def num_samples(self) -> int:
        return self.node_of.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def causal_mask(self) -> Tensor:
        """[1, 1, N, N] bool, True = masked (megatron-core's convention): node n sees node m iff m is n
        or an ancestor of n. Built depth by depth: a node's row is its parent's row plus itself."""
        num = self.num_tokens
        device = self.tokens.device
        visible = torch.eye(num, dtype=torch.bool, device=device)
        depth = self.position_ids[0]
        for d in range(1, int(depth.max()) + 1 if num else 0):
            nodes = torch.nonzero(depth == d).squeeze(1)
            visible[nodes] |= visible[self.parents[nodes]]
        return ~visible.view(1, 1, num, num)

    def subtree_ends(self) -> Tensor:
        """[1, N] long: what the flex tree attention (``models.tree_attention``) takes in the attention-mask
        argument; node n sees node m iff ``m <= n < ends[m]``."""
        return self.ends.view(1, -1)

    def predictions(self, response_mask: Tensor | None = None) -> TreePredictions:
        """Every (sample, column j >= 1) with a real token (and, with ``response_mask`` [B, T], a
        response token), sample-major: the rows the output layer runs on."""
        real = self.node_of >= 0
        keep = real[:, 1:].clone()
        if response_mask is not None:
            keep &= response_mask[:, 1:].bool()
        samples, before = torch.nonzero(keep, as_tuple=True)
        columns = before + 1
        positions = self.node_of[samples, before]
        targets = self.tokens[0, self.node_of[samples, columns]]
        return TreePredictions(positions=positions, samples=samples, columns=columns, targets=targets)


def tree_pack(tokens: Tensor, attention_mask: Tensor) -> TreeBatch:
    """Merge right-padded ``tokens`` [B, T] (``attention_mask`` True = real token) into a trie of exact
    token prefixes, nodes in DFS preorder: rows inserted in lexicographic token order (ties by index),
    each row's new tokens left to right. Every row between two rows that share a prefix shares it too,
    so a node's descendants are created before any node outside its subtree (checked: ``_subtree_ends``)."""
    if tokens.shape != attention_mask.shape or tokens.dim() != 2:
        raise ValueError(
            f"tree_pack: tokens {tuple(tokens.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    if not torch.equal(mask, columns[None, :] < lengths[:, None]):
        raise ValueError("tree_pack: attention_mask must be right padding (each row's real tokens first)")
    node_tokens: list[int]
    parents: list[int]
    depths: list[int]
    node_tokens, parents, depths = [], [], []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    node_of = torch.full(tokens.shape, -1, dtype=torch.long)
    rows = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]
    for i in sorted(range(len(rows)), key=lambda i: (rows[i], i)):
        parent = -1
        for j in range(len(rows[i])):
            key = (parent, rows[i][j])
            node = children.get(key)
            if node is None:
                node = children[key] = len(node_tokens)
                node_tokens.append(rows[i][j])
                parents.append(parent)
                depths.append(j)
            node_of[i, j] = node
            parent = node
    device = tokens.device
    return TreeBatch(
        tokens=torch.tensor([node_tokens], dtype=torch.long, device=device),
        position_ids=torch.tensor([depths], dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        ends=torch.tensor(_subtree_ends(parents), dtype=torch.long, device=device),
        node_of=node_of.to(device),
        seq_len=tokens.shape[1],
    )


def _subtree_ends(parents: list[int]) -> list[int]:
    """``n + size(subtree of n)`` per node; asserts the layout is a preorder, i.e. every subtree is the
    interval ``[n, ends[n])``: each node lies inside its parent's interval, after it, and its own
    interval inside its parent's (by induction every descendant of m lies in ``[m, ends[m])``, and
    that interval holds exactly size(m) nodes)."""
    sizes = [1] * len(parents)
    for node in range(len(parents) - 1, -1, -1):  # children come after their parent
        if parents[node] >= 0:
            sizes[parents[node]] += sizes[node]
    ends = [node + size for node, size in enumerate(sizes)]
    for node, parent in enumerate(parents):
        assert parent < 0 or parent < node < ends[parent] and ends[node] <= ends[parent], (
            f"tree layout is not a DFS preorder at node {node} (parent {parent})"
        )
    return ends


class _Trie:
    """Node count of a growing set of token rows (children keyed by (parent, token); O(row) per row)."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}

    def new_nodes(self, row: list[int]) -> int:
        """Nodes ``row`` would add."""
        parent, j = -1, 0
        while j < len(row) and (parent, row[j]) in self.children:
            parent = self.children[(parent, row[j])]
            j += 1
        return len(row) - j

    def add(self, row: list[int]) -> None:
        parent = -1
        for token in row:
            parent = self.children.setdefault((parent, token), len(self.children))

    def __len__(self) -> int:
        return len(self.children)


def _rows(tokens: Tensor, attention_mask: Tensor) -> list[list[int]]:
    return [
        row[:n] for row, n in zip(tokens.tolist(), attention_mask.bool().sum(dim=1).tolist(), strict=False)
    ]  # strict=False: rows of one [B, T] batch by the caller's contract


def tree_tokens(tokens: Tensor, attention_mask: Tensor) -> int:
    """Nodes of the trie of these rows (what a tree-packed micro-batch of them forwards)."""
    trie = _Trie()
    for row in _rows(tokens, attention_mask):
        trie.add(row)
    return len(trie)


def split_by_tree_tokens(
    tokens: Tensor, attention_mask: Tensor, max_tokens: int, *, max_samples: int | None = None
) -> list[list[int]]:
    """Row indices per micro-batch, cut by *tree* tokens: rows in lexicographic token order (shared
    prefixes adjacent), each added to the open micro-batch while its trie stays within ``max_tokens``
    nodes and ``max_samples`` rows; a row alone over budget gets a micro-batch of its own.
    Deterministic; rows within each micro-batch in ascending index order."""
    if max_tokens < 1 or (max_samples is not None and max_samples < 1):
        raise ValueError(f"max_tokens/max_samples must be >= 1, got {max_tokens}/{max_samples}")
    rows = _rows(tokens, attention_mask)
    groups: list[list[int]] = []
    trie = _Trie()
    for i in sorted(range(len(rows)), key=lambda i: (rows[i], i)):
        full = max_samples is not None and groups and len(groups[-1]) >= max_samples
        if not groups or full or len(trie) + trie.new_nodes(rows[i]) > max_tokens:
            groups.append([])
            trie = _Trie()
        groups[-1].append(i)
        trie.add(rows[i])
    return [sorted(g) for g in groups]


def place_tree(values: Tensor, predictions: TreePredictions, num_samples: int, seq_len: int) -> Tensor:
    """Per-prediction ``values`` [1, K] or [K] -> [B, seq_len] at each row's (sample, column); 0
    elsewhere. Differentiable."""
    values = values[0] if values.dim() == 2 else values
    out = values.new_zeros(num_samples * seq_len)
    out = out.index_copy(0, predictions.samples * seq_len + predictions.columns, values)
    return out.view(num_samples, seq_len)


def tree_logprobs(
    logits: Tensor,  # [1, K, V_local]: row k is the output at predictions.positions[k]
    tree: TreeBatch,
    predictions: TreePredictions,
    *,
    tp_group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [B, T], entropy [B, T]) of each predicted token, aligned like the padded path's
    (``vocab_parallel_logprobs``): value at (i, j) is log p(token j of sample i | its tokens < j)."""
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != predictions.positions.shape[0]:
        raise ValueError(
            f"tree_logprobs: logits {tuple(logits.shape)} must be "
            f"[1, {predictions.positions.shape[0]}, V_local]"
        )
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        logits, predictions.targets.unsqueeze(0), tp_group, vocab_start, vocab_size
    )
    seq_len = tree.seq_len if seq_len is None else seq_len
    return (
        place_tree(logprobs, predictions, tree.num_samples, seq_len),
        place_tree(entropy, predictions, tree.num_samples, seq_len),
    )


class RotaryPositions:
    """Rotates by per-token positions (a tree node's depth) instead of the layout index.

    megatron-core's local spec builds its rotary table for positions ``0..S-1`` of the layout
    (``GPTModel.rotary_pos_emb(seq_len)`` -> [S, 1, 1, D]) and ignores ``position_ids``; a forward hook
    on that module re-indexes the table by ``positions`` [S] while set (``None``: unchanged, as every
    other forward needs it). A node's depth is below the layout length, so the table covers it."""

    def __init__(self, model: torch.nn.Module):
        self.positions: Tensor | None = None
        rotary = getattr(unwrap(model), "rotary_pos_emb", None)
        self.enabled = rotary is not None
        if self.enabled:
            assert rotary is not None  # enabled
            rotary.register_forward_hook(self._reindex)

    def _reindex(self, module, args, output):
        if self.positions is None:
            return output
        table = output[0] if isinstance(output, tuple) else output  # yarn returns (emb, mscale)
        moved = table[self.positions]
        return (moved, *output[1:]) if isinstance(output, tuple) else moved


@dataclass(frozen=True)
class TreeView:
    """What a tree micro-batch's loss needs besides the logits: the tree, its prediction rows, and
    whether the output layer already ran on those rows only (``LogitWindow.select``) or on every node."""

    tree: TreeBatch
    predictions: TreePredictions
    gathered: bool

    def rows(self, out: Tensor) -> Tensor:
        """The prediction rows [1, K, ...] of an output [1, K or N, ...]."""
        return out if self.gathered else out[:, self.predictions.positions]


def first_prediction(predictions: TreePredictions) -> TreePredictions:
    """The first row alone: a zero-weight stand-in micro-batch keeps the graph connected with it."""
    return TreePredictions(
        *(
            t[:1]
            for t in (predictions.positions, predictions.samples, predictions.columns, predictions.targets)
        )
    )
