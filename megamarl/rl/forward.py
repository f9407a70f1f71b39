"""Helpers of the policy's forward pass: masks, the output layer's logit window, and the row
bookkeeping that cuts a DP part into micro-batches and puts per-row results back.

``LogitWindow`` runs the output layer only where response tokens are predicted (prompts are most of
every multi-agent transcript, and [T, V] logits dominate a small model's step); the row helpers key
rows by (episode, agent, turn, branch), so micro-batches may regroup rows (e.g. by agent).
"""

from __future__ import annotations

import torch

from megamarl.models.bridge import unwrap
from megamarl.rl.batch import SampleBatch


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron-core convention); right padding needs nothing more."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def first_logit_position(response_mask: torch.Tensor) -> int:
    """Earliest position whose logits predict a response token (one before the first response token)."""
    has_response = response_mask.any(dim=1)
    if not has_response.any():
        return 0
    first = response_mask[has_response].float().argmax(dim=1).min()
    return max(int(first) - 1, 0)


def restricted_vocab_mask(allowed, vocab_start: int, num_local: int,
                          device: torch.device | str = "cpu") -> torch.Tensor | None:
    """[B, V_local] True where a row's sampling excluded the token (rows without a set: all False)."""
    if not any(allowed):
        return None
    mask = torch.zeros(len(allowed), num_local, dtype=torch.bool, device=device)
    for row, ids in enumerate(allowed):
        if ids:
            local = torch.tensor(ids, dtype=torch.long, device=device) - vocab_start
            mask[row] = True
            mask[row, local[(local >= 0) & (local < num_local)]] = False
    return mask


class LogitWindow:
    """Runs the output layer only from position ``start`` on.

    A forward pre-hook slices the decoder output before the output layer, so parameter names and the
    model are unchanged. Off (start stays 0) with sequence parallelism, where the decoder output is
    sharded along the sequence.
    """

    def __init__(self, model: torch.nn.Module):
        self.start = 0
        self.positions: torch.Tensor | None = None  # packed rows: exactly these positions
        self.hidden: torch.Tensor | None = None  # the last forward's windowed decoder output [W, B, H]
        gpt = unwrap(model)
        self.enabled = bool(getattr(gpt, "post_process", False)) and not gpt.config.sequence_parallel
        if self.enabled:
            gpt.output_layer.register_forward_pre_hook(self._slice)

    def set(self, response_mask: torch.Tensor) -> int:
        self.positions = None
        self.start = first_logit_position(response_mask) if self.enabled else 0
        return self.start

    def select(self, positions: torch.Tensor) -> bool:
        """Packed rows: run the output layer on ``positions`` [K] of the packed row only (the
        positions whose next token is a response token); False when the hook is off."""
        self.start, self.positions = 0, positions if self.enabled else None
        return self.enabled

    def _slice(self, module, args):
        # decoder output is [S, B, H]; packed: [L, 1, H] -> [K, 1, H]
        self.hidden = args[0][self.start :] if self.positions is None else args[0][self.positions]
        return (self.hidden,) + tuple(args[1:])


def model_shape(mb: SampleBatch, packed: bool) -> tuple[int, int]:
    """(rows, tokens) the model sees for ``mb``: [B, T] padded, [1, sum of lengths] packed."""
    return (1, int(mb.lengths.sum())) if packed else (mb.num_samples, mb.tokens.shape[1])


def _row_ids(mb: SampleBatch) -> list[tuple[int, int, int, int]]:
    return list(zip(mb.episode.tolist(), mb.agent.tolist(), mb.turn.tolist(), mb.branch.tolist()))


def split_rows(
    full: torch.Tensor | None, micro_batches: list[SampleBatch], part: SampleBatch
) -> list[torch.Tensor] | None:
    """Cut per-row tensors of ``part`` ([B, T]) into the rows and width of each micro-batch (which may
    regroup rows, e.g. by agent)."""
    if full is None:
        return None
    index = {key: i for i, key in enumerate(_row_ids(part))}
    return [full[[index[k] for k in _row_ids(mb)], : mb.tokens.shape[1]] for mb in micro_batches]


def merge_rows(
    pieces: list[torch.Tensor], micro_batches: list[SampleBatch], part: SampleBatch, width: int
) -> torch.Tensor:
    """Inverse of ``split_rows``: micro-batch rows back into ``part``'s row order, padded to ``width``."""
    index = {key: i for i, key in enumerate(_row_ids(part))}
    out = pieces[0].new_zeros(part.num_samples, width)
    for piece, mb in zip(pieces, micro_batches):
        out[[index[k] for k in _row_ids(mb)], : piece.shape[1]] = piece
    return out
