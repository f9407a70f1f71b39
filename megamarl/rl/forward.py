"""The policy's forward pass over one micro-batch, in its three layouts (padded rows, one packed row,
one row of prefix-trie nodes), and what turns its logits into the sampled tokens' log-probs; with
masks, the output layer's logit window, and the row bookkeeping that puts per-row results back.

``LogitWindow`` runs the output layer only where response tokens are predicted (prompts are most of
every multi-agent transcript, and [T, V] logits dominate a small model's step); the row helpers key
rows by (episode, agent, turn, branch), so micro-batches may regroup rows (e.g. by agent).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megamarl.models.bridge import unwrap
from megamarl.rl.batch import SampleBatch
from megamarl.rl.packing import pack, packed_logprobs, prediction_positions
from megamarl.rl.tree import RotaryPositions, TreeView, first_prediction, tree_logprobs, tree_pack
from megamarl.rl.vocab_parallel import scale_logits, vocab_parallel_logprobs


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


def restricted_vocab_mask(
    allowed, vocab_start: int, num_local: int, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
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
    return list(
        zip(mb.episode.tolist(), mb.agent.tolist(), mb.turn.tolist(), mb.branch.tolist(), strict=True)
    )


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
    for piece, mb in zip(
        pieces, micro_batches, strict=False
    ):  # strict=False: one piece per micro-batch by the caller's contract
        out[[index[k] for k in _row_ids(mb)], : piece.shape[1]] = piece
    return out


# ---- one micro-batch through the model: (output, where its predictions sit) --------------------------


def padded_forward(model, window: LogitWindow, mb: SampleBatch):
    """Right-padded rows [B, T], causal attention, the output layer from the first response prediction
    on; ``where`` is that window offset."""
    seq_len = mb.tokens.shape[1]
    positions = torch.arange(seq_len, device=mb.device).expand_as(mb.tokens)
    offset = window.set(mb.response_mask)
    return model(mb.tokens, positions, causal_mask(seq_len, mb.device)), offset


def packed_forward(model, window: LogitWindow, mb: SampleBatch, *, uses_te: bool):
    """``mb``'s rows as one packed row [1, L] (``rl.packing``): block-diagonal causal attention (the
    local spec's explicit mask on CPU; megatron-core's ``PackedSeqParams`` (THD) with Transformer
    Engine), positions restarting per sample, the output layer only where a response token is
    predicted; ``where`` is ``(packed, positions)``."""
    packed = pack(mb.tokens, mb.attention_mask)
    positions = prediction_positions(packed, mb.response_mask)
    if not positions.numel():  # a zero-weight stand-in row: any position keeps the graph connected
        positions = prediction_positions(packed)[:1]
    if not window.select(positions):
        positions = torch.arange(packed.num_tokens, device=mb.device)  # sequence parallel: whole row
    if uses_te:
        output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.seq_params())
    else:
        output = model(packed.tokens, packed.position_ids, packed.causal_mask())
    return output, (packed, positions)


def tree_forward(model, window: LogitWindow, rotary: RotaryPositions, mb: SampleBatch):
    """``mb``'s rows as one row of prefix-trie nodes (``rl.tree``): ancestor-only attention (the model's
    ``tree_attention``: the dense mask for the local spec's attention, the subtree ends for
    ``models.tree_attention``), RoPE by node depth, the output layer on the prediction rows only;
    ``where`` is a ``TreeView``."""
    tree = tree_pack(mb.tokens, mb.attention_mask)
    predictions = tree.predictions(mb.response_mask)
    if not predictions.positions.numel():  # a zero-weight stand-in row: any row keeps the graph connected
        predictions = first_prediction(tree.predictions())
    gathered = window.select(predictions.positions)
    rotary.positions = tree.position_ids[0]
    try:
        flex = unwrap(model).tree_attention == "flex"
        output = model(tree.tokens, tree.position_ids, tree.subtree_ends() if flex else tree.causal_mask())
    finally:
        rotary.positions = None
    return output, TreeView(tree, predictions, gathered)


def sampled_logprobs(
    logits: torch.Tensor, mb: SampleBatch, where, *, tp_group, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [B, T] of ``mb``'s tokens from vocab-parallel ``logits``. ``where``: the
    window offset of padded rows, ``(packed, positions)`` for a packed row (logits [1, K, V_local] at
    ``positions``), or a ``TreeView`` (logits at its prediction rows)."""
    packed = tree = None
    if isinstance(where, TreeView):  # each prediction row with its own sample's sampling settings
        tree = where
        rows = tree.predictions.samples.tolist()
        logits = tree.rows(logits).transpose(0, 1)  # [K, 1, V]
    elif isinstance(where, tuple):  # one packed row: per-position sampling settings of its sample
        packed, positions = where
        rows = packed.sample_ids[positions].tolist()
        logits = logits.transpose(0, 1)  # [K, 1, V]: each position its own "row"
    temperatures: Sequence[float]
    allowed: Sequence[tuple[int, ...] | None]
    if tree is not None or packed is not None:
        temperatures = [mb.temperatures[r] for r in rows] if mb.temperatures else ()
        allowed = [mb.allowed[r] for r in rows] if mb.allowed else ()
    else:
        temperatures, allowed = mb.temperatures, mb.allowed
    # the distribution the engine sampled from; temperature scaling and log-softmax in fp32 whatever
    # the compute dtype
    logits = scale_logits(logits, temperatures)
    disallowed = restricted_vocab_mask(allowed, vocab_start, logits.shape[-1], logits.device)
    if disallowed is not None:  # renormalise over the set the engine sampled from
        logits = logits.masked_fill(disallowed.unsqueeze(1), float("-inf"))
    seq_len = mb.tokens.shape[1]
    if tree is not None:
        return tree_logprobs(
            logits.transpose(0, 1),
            tree.tree,
            tree.predictions,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            seq_len=seq_len,
        )
    if packed is not None:
        return packed_logprobs(
            logits.transpose(0, 1),
            packed,
            positions=positions,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            seq_len=seq_len,
        )
    return vocab_parallel_logprobs(
        logits, mb.tokens, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, offset=where
    )
