"""Sequence packing for the training forward pass: a micro-batch's rows laid end to end in one
row of ``L = sum(lengths)`` tokens, with no padding.

Unlike the padded forward (``SampleBatch.micro_batches``), no FLOPs go to padding. Each sample sees
only itself: megatron-core's local attention through the block-diagonal mask
``PackedBatch.causal_mask()`` (RoPE by packed position, equal up to fp32 rounding), Transformer Engine
through ``PackedBatch.seq_params()`` (``thd`` with ``cu_seqlens``). Alignment: the output at packed
position ``s_i + j - 1`` predicts token ``j`` of sample ``i``, placed at the padded layout's ``(i, j)``; a
sample's last position is never a prediction position. ``prediction_positions`` (optionally response
tokens only) and ``packed_logprobs`` (``[B, T]`` logprobs/entropy, same TP math) are the entry points.
Pure tensor functions: no process groups but an optional ``tp_group``, no config.
The alignment argument in full: docs/design-notes.md, "megamarl/rl/packing.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megamarl.rl.vocab_parallel import _VocabParallelLogprobEntropy

# ---- micro-batches by token budget --------------------------------------------------------------


def split_by_tokens(
    lengths: Sequence[int] | Tensor, max_tokens: int, *, max_samples: int | None = None
) -> list[list[int]]:
    """Row indices per micro-batch: each micro-batch's total *unpadded* tokens <= ``max_tokens`` and
    rows <= ``max_samples``; a row longer than ``max_tokens`` gets a micro-batch of its own.

    First-fit decreasing: rows by decreasing length (ties: lower index first) go into the first
    micro-batch with room, else open a new one. Packed cost is ~linear in a micro-batch's tokens, so
    the goal is few, full micro-batches; FFD needs at most ``11/9 OPT + 6/9`` of them, where the
    in-order split (``SampleBatch.micro_batches``) can need nearly twice as many for mixed lengths.
    Deterministic: same lengths, same split. Micro-batches come in the order they were opened
    (longest first row first); the rows within each are in ascending index order.
    """
    if max_tokens < 1 or (max_samples is not None and max_samples < 1):
        raise ValueError(f"max_tokens/max_samples must be >= 1, got {max_tokens}/{max_samples}")
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    groups: list[list[int]] = []
    loads: list[int] = []  # tokens per group
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens and (max_samples is None or len(groups[g]) < max_samples):
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return [sorted(g) for g in groups]


def padded_shapes(lengths: Sequence[int] | Tensor, groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(rows, longest row)`` of each group if it were padded (as ``SampleBatch.select`` trims it)."""
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    return [(len(g), max((lengths[i] for i in g), default=0)) for g in groups]


def padding_fraction(lengths: Sequence[int] | Tensor, shapes: Sequence[tuple[int, int]]) -> float:
    """Fraction of the token slots of padded micro-batches ``shapes`` [(rows, width)] that are
    padding, for rows of ``lengths`` (all rows of those micro-batches). Packed micro-batches have
    none, so this is the share of the padded forward's token slots that packing saves (metric
    ``perf/padding_fraction/<policy>``)."""
    num_tokens = int(sum(lengths.tolist() if isinstance(lengths, Tensor) else lengths))
    num_slots = sum(rows * width for rows, width in shapes)
    if num_tokens > num_slots:
        raise ValueError(f"padding_fraction: {num_tokens} tokens do not fit in {num_slots} padded slots")
    return 1.0 - num_tokens / num_slots if num_slots else 0.0


# ---- packing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as a single packed row (B samples, L real tokens, padded width T)."""

    tokens: Tensor  # [1, L] long: every sample's real tokens, end to end
    position_ids: Tensor  # [1, L] long: 0..n_i-1 within each sample
    cu_seqlens: Tensor  # [B + 1] int32: sample i is tokens[0, cu_seqlens[i]:cu_seqlens[i + 1]]
    sample_ids: Tensor  # [L] long: the sample (row of the padded batch) of each packed position
    seq_len: int  # T: width of the padded batch it came from (``unpack``'s default width)
    max_seqlen: int  # longest sample

    @property
    def num_samples(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def causal_mask(self) -> Tensor:
        """[1, 1, L, L] bool, True = masked (megatron-core's convention): query p sees key q iff both
        lie in the same sample and q <= p. O(L^2) memory: built on demand (the TE path needs none)."""
        ids = self.sample_ids
        positions = torch.arange(self.num_tokens, device=ids.device)
        visible = (ids[:, None] == ids[None, :]) & (positions[None, :] <= positions[:, None])  # [L, L]
        return ~visible.view(1, 1, self.num_tokens, self.num_tokens)

    def seq_params(self):
        """megatron-core ``PackedSeqParams`` for Transformer Engine's ``thd`` attention (pass with
        ``attention_mask=None``)."""
        # megatron.core imported here: it costs seconds, and the pure functions above need none of it
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def flat_index(self, seq_len: int | None = None) -> Tensor:
        """[L] long: ``i * seq_len + j`` of each packed token in the padded [B, seq_len] layout."""
        seq_len = self.seq_len if seq_len is None else seq_len
        if seq_len < self.max_seqlen:
            raise ValueError(
                f"seq_len={seq_len} is shorter than the longest packed sample ({self.max_seqlen})"
            )
        return self.sample_ids * seq_len + self.position_ids[0]


def pack(tokens: Tensor, attention_mask: Tensor) -> PackedBatch:
    """Pack right-padded ``tokens`` [B, T] (``attention_mask`` [B, T] bool, True = real token) into
    one row; sample order is row order."""
    if tokens.shape != attention_mask.shape or tokens.dim() != 2:
        raise ValueError(
            f"pack: tokens {tuple(tokens.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    mask = attention_mask.bool()
    num_samples, seq_len = tokens.shape
    device = tokens.device
    lengths = mask.sum(dim=1)  # [B]
    columns = torch.arange(seq_len, device=device)
    if not torch.equal(mask, columns[None, :] < lengths[:, None]):
        raise ValueError("pack: attention_mask must be right padding (each row's real tokens first)")
    cu_seqlens = torch.zeros(num_samples + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    sample_ids = torch.repeat_interleave(torch.arange(num_samples, device=device), lengths)  # [L]
    position_ids = columns.expand(num_samples, seq_len)[mask]  # [L], row-major = packing order
    return PackedBatch(
        tokens=tokens[mask].unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        sample_ids=sample_ids,
        seq_len=seq_len,
        max_seqlen=int(lengths.max()) if num_samples else 0,
    )


def unpack(values: Tensor, packed: PackedBatch, seq_len: int | None = None) -> Tensor:
    """Per-token ``values`` [1, L, ...] or [L, ...] at packed positions -> [B, seq_len, ...] in the
    padded layout (value at packed position p goes to its own token's slot; zeros in padding).
    Differentiable in ``values``. ``seq_len`` defaults to the padded width ``pack`` saw."""
    num_tokens = packed.num_tokens
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == num_tokens:
        values = values[0]
    if values.shape[0] != num_tokens:
        raise ValueError(f"unpack: values {tuple(values.shape)} do not cover the {num_tokens} packed tokens")
    seq_len = packed.seq_len if seq_len is None else seq_len
    out = values.new_zeros(packed.num_samples * seq_len, *values.shape[1:])
    out = out.index_copy(0, packed.flat_index(seq_len), values)
    return out.view(packed.num_samples, seq_len, *values.shape[1:])


# ---- predictions: logits at packed position p predict token p + 1 ----------------------------------


def prediction_positions(packed: PackedBatch, response_mask: Tensor | None = None) -> Tensor:
    """LongTensor [K], ascending: packed positions ``p`` whose next token ``p + 1`` belongs to the
    same sample (never a sample's last position) and, with ``response_mask`` [B, T] (the padded
    batch's), is a response token. Index the decoder output [L, 1, H] with it before the output
    layer and the logits cost K rows instead of L."""
    ids = packed.sample_ids
    keep = ids[1:] == ids[:-1]  # [L - 1]: position p = index, target p + 1 in the same sample
    if response_mask is not None:
        target_slots = packed.flat_index(response_mask.shape[1])[1:]
        keep = keep & response_mask.reshape(-1)[target_slots].bool()
    return torch.nonzero(keep).squeeze(1)


def place_predictions(
    values: Tensor, packed: PackedBatch, positions: Tensor, seq_len: int | None = None
) -> Tensor:
    """Per-position ``values`` [1, K] or [K], computed at packed ``positions`` [K] (prediction
    positions), -> [B, seq_len] aligned with the tokens they predict (like ``place_window``): the
    value from position p lands on token p + 1's slot; every other slot is 0. Differentiable."""
    values = values[0] if values.dim() == 2 else values
    seq_len = packed.seq_len if seq_len is None else seq_len
    out = values.new_zeros(packed.num_samples * seq_len)
    out = out.index_copy(0, packed.flat_index(seq_len)[positions + 1], values)
    return out.view(packed.num_samples, seq_len)


def packed_logprobs(
    logits: Tensor,  # [1, W, V_local]: row k sits at packed position positions[k]
    packed: PackedBatch,
    *,
    positions: Tensor | None = None,  # [W] long; None: W = L, row k at position k (the whole row)
    tp_group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [B, T], entropy [B, T]) from vocab-parallel logits of the packed row, aligned with
    the padded tokens exactly as ``vocab_parallel_logprobs`` aligns a padded micro-batch's: value at
    (i, j) is log p(token j of sample i | its tokens < j). Slots without a prediction (j = 0,
    padding, positions not in ``positions``) are 0, where the padded path puts its (masked-out)
    values of pad tokens.

    Rows of ``logits`` at positions that predict nothing (a sample's last token, whose next token is
    the next sample's first) are dropped before the reduction: they never leak into a sample and
    get exactly zero gradient. Every TP rank of ``tp_group`` must pass the same ``positions``.
    ``vocab_size`` None means no vocab padding columns (as in ``vocab_parallel_logprobs``).
    """
    num_tokens = packed.num_tokens
    if positions is None:
        positions = torch.arange(num_tokens, device=logits.device)
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != positions.shape[0]:
        raise ValueError(
            f"packed_logprobs: logits {tuple(logits.shape)} must be [1, {positions.shape[0]}, V_local]"
        )
    ids = packed.sample_ids
    nxt = (positions + 1).clamp(max=max(num_tokens - 1, 0))
    valid = (positions + 1 < num_tokens) & (ids[positions] == ids[nxt])  # [W]
    if not bool(valid.all()):  # a whole-row input, or positions that include sample ends
        positions, logits = positions[valid], logits[:, valid]
    targets = packed.tokens[0, positions + 1].unsqueeze(0)  # [1, K]
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(logits, targets, tp_group, vocab_start, vocab_size)
    return (
        place_predictions(logprobs, packed, positions, seq_len),
        place_predictions(entropy, packed, positions, seq_len),
    )
