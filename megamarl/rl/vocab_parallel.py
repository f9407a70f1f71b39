"""Per-token log-probabilities and entropy from vocab-parallel logits, with an explicit TP group.

Each tensor-parallel rank holds logits for its slice of the vocabulary ``[vocab_start,
vocab_start + V_local)``. megatron-core's ``vocab_parallel_cross_entropy`` does the same reduction
but reads the *global* ``parallel_state`` TP group, which megamarl does not set (every worker group
has its own groups), so this variant takes ``tp_group`` as an argument. Forward: four all-reduces
per call, each of one value per row: the max, the sum of exponentials, the target logit and the
expected logit (for the entropy). Backward is local (no communication):

    d logp(y) / d z_i = 1[i = y] - p_i
    H = log Z - sum_i p_i z_i,      d H / d z_i = -p_i (z_i - sum_j p_j z_j)

Columns at or beyond ``vocab_size`` (vocab padding for TP divisibility) are masked to -inf so they
never take probability mass. Rows are reduced in chunks of ``LOGPROB_CHUNK_BYTES`` and backward
recomputes each chunk's probabilities from three saved values per row: no ``[rows, V]`` fp32
temporary beyond the input is kept, with the same bits as one pass over all rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 bytes of one chunk of rows x V_local: the reduction's temporaries (shifted logits, exp,
# probabilities) exist for one chunk at a time, not for the micro-batch's whole [rows, V] logits
LOGPROB_CHUNK_BYTES = 32 * 2**20


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Rows in chunks of ``LOGPROB_CHUNK_BYTES``; forward keeps the input logits (no copy) and three
    values per row (max, sum of exp, expected shifted logit) for backward, which recomputes each
    chunk's probabilities from them: the same floating-point operations per element as one pass over
    all rows, so the same bits, with O(chunk x V) temporaries instead of several [rows, V] tensors
    (two of which, the probabilities and shifted logits, used to live until backward)."""

    @staticmethod
    def forward(ctx, logits, targets, tp_group, vocab_start, vocab_size):  # logits [B, T, V_local] float
        num_local = logits.shape[-1]
        rows = logits.detach().reshape(-1, num_local)  # [N, V_local]
        pad_from = max(vocab_size - vocab_start, 0) if vocab_start + num_local > vocab_size else None
        chunks = _chunks(rows.shape[0], num_local)
        z_max = rows.new_empty(rows.shape[0], dtype=torch.float32)
        for c in chunks:
            z_max[c] = _fp32(rows[c], pad_from).max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, tp_group)
        local_target = targets.reshape(-1) - vocab_start
        in_range = (local_target >= 0) & (local_target < num_local)
        index = local_target.clamp(0, num_local - 1).unsqueeze(-1)
        sum_exp, target_shifted = z_max.new_empty(z_max.shape), z_max.new_empty(z_max.shape)
        for c in chunks:
            shifted = _fp32(rows[c], pad_from) - z_max[c].unsqueeze(-1)
            sum_exp[c] = shifted.exp().sum(dim=-1)
            target_shifted[c] = torch.gather(_finite(shifted), -1, index[c]).squeeze(-1) * in_range[c]
        _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
        _all_reduce(target_shifted, dist.ReduceOp.SUM, tp_group)
        expected_shifted = z_max.new_empty(z_max.shape)  # sum_j p_j z_j over the whole vocab (finite columns)
        for c in chunks:
            shifted = _fp32(rows[c], pad_from) - z_max[c].unsqueeze(-1)
            probs = shifted.exp() / sum_exp[c].unsqueeze(-1)
            expected_shifted[c] = (probs * _finite(shifted)).sum(dim=-1)
        _all_reduce(expected_shifted, dist.ReduceOp.SUM, tp_group)
        log_z = sum_exp.log()
        logprobs = (target_shifted - log_z).view(targets.shape)
        entropy = (log_z - expected_shifted).view(targets.shape)
        ctx.pad_from = pad_from
        ctx.save_for_backward(logits, z_max, sum_exp, expected_shifted, index, in_range)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, z_max, sum_exp, expected_shifted, index, in_range = ctx.saved_tensors
        num_local = logits.shape[-1]
        rows = logits.detach().reshape(-1, num_local)
        grad_logprobs, grad_entropy = grad_logprobs.reshape(-1, 1), grad_entropy.reshape(-1, 1)
        grad = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        for c in _chunks(rows.shape[0], num_local):
            shifted = _fp32(rows[c], ctx.pad_from) - z_max[c].unsqueeze(-1)
            probs = shifted.exp() / sum_exp[c].unsqueeze(-1)
            g = -probs * grad_logprobs[c]
            onehot = torch.zeros_like(probs).scatter_(-1, index[c], in_range[c].unsqueeze(-1).to(probs.dtype))
            g = g + onehot * grad_logprobs[c]
            grad[c] = g - probs * (_finite(shifted) - expected_shifted[c].unsqueeze(-1)) * grad_entropy[c]
        return grad.view(logits.shape), None, None, None, None


def _chunks(num_rows: int, num_local: int) -> list[slice]:
    step = max(1, LOGPROB_CHUNK_BYTES // (4 * max(num_local, 1)))
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def _fp32(rows: torch.Tensor, pad_from: int | None) -> torch.Tensor:
    """A chunk of rows in fp32 (a copy: the caller's tensor is never written), padded vocabulary
    columns (``pad_from`` on) at -inf so they never take probability mass."""
    z = rows.float()
    if pad_from is not None:
        z = z.clone() if z.data_ptr() == rows.data_ptr() else z
        z[..., pad_from:] = float("-inf")
    return z


def _finite(shifted: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))


def scale_logits(logits: torch.Tensor, temperatures) -> torch.Tensor:
    """``logits [B, W, V] / temperature[b]`` computed in fp32 whatever the logits' dtype: a bf16
    division rounds every logit to 8 mantissa bits (~0.03 nats mean logprob error at T=0.7, an 8%
    importance-weight error), and the log-softmax below runs in fp32 anyway. All-1 temperatures
    only upcast."""
    z = logits.float()
    if all(t == 1.0 for t in temperatures):
        return z
    return z / torch.tensor(list(temperatures), dtype=torch.float32, device=z.device).view(-1, 1, 1)


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,  # [B, W, V_local]; logits[:, i] sit at position offset + i, predict the next token
    tokens: torch.Tensor,  # [B, T]
    *,
    tp_group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprobs [B, T], entropy [B, T]) aligned with ``tokens``: value at t is the logprob of
    tokens[t] given tokens[:t]. Positions without logits (position 0, and every t <= ``offset`` when
    the logits cover only the window ``[offset, offset + W)``) get 0."""
    vocab_size = vocab_size if vocab_size is not None else vocab_start + logits.shape[-1] * _size(tp_group)
    _batch, seq_len = tokens.shape
    width = min(logits.shape[1], seq_len - 1 - offset)
    targets = tokens[:, offset + 1 : offset + 1 + width]
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        logits[:, :width], targets, tp_group, vocab_start, vocab_size
    )
    return place_window(logprobs, seq_len, offset), place_window(entropy, seq_len, offset)


def place_window(values: torch.Tensor, seq_len: int, offset: int) -> torch.Tensor:
    """Per-token values [B, W] computed from the logits/hidden states at positions ``offset + i``
    (which predict token ``offset + i + 1``) -> [B, seq_len] aligned with the tokens, 0 elsewhere."""
    width = min(values.shape[1], seq_len - 1 - offset)
    left = values.new_zeros(values.shape[0], offset + 1)
    right = values.new_zeros(values.shape[0], seq_len - 1 - offset - width)
    return torch.cat([left, values[:, :width], right], dim=1)


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
