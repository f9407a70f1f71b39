"""Rollout/training mismatch: importance weights between the trainer's log-probs and the rollout
engine's, and the statistics of the mismatch itself, as pure tensor functions.

The engine samples from ``mu`` (its own numerics, in async modes also older weights); the trainer
scores the same tokens under ``pi`` (``old_logprobs``). With ``d_t = log pi_t - log mu_t`` a level
gives every token a ratio: ``token`` ``exp(d_t)``, ``sequence`` ``exp(sum_t d_t)`` (the row's), and
``geometric`` ``exp(mean_t d_t)`` (the row's per-token geometric mean, length-independent). Each level
then truncates (TIS: ``min(ratio, upper)``), masks (the ratio inside [lower, upper], 0 outside: IcePop
at token level) or rejects (weight 1 inside; a row with any ratio outside is dropped whole: rejection
sampling as in verl's ``rollout_rs`` and slime's MIS). Levels' weights multiply. Unlike verl, the
bounds are the same kind of number at every level (a ratio), and "mask" keeps the ratio as the weight.
Log-ratios are clamped to +-20 before ``exp``; padding (``mask`` False) never reaches a value.
Shapes: ``[B, T]`` with a boolean ``mask [B, T]`` of response tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megamarl.config_sections import MISMATCH_LEVELS, MismatchConfig

MISMATCH_LOG_CLAMP = 20.0  # exp(+-20) is finite in fp32
# columns of ``mismatch_row_sums``: summed per row, then over any set of rows (an agent's)
MISMATCH_SUMS = ("tokens", "log_ratio", "k3", "dropped_tokens", "sequences", "rejected")


def mismatch_log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, level: str) -> Tensor:
    """``[B, T]`` log-ratio of ``level`` at every response token (0 elsewhere): token ``d_t``,
    sequence ``sum_t d_t``, geometric ``mean_t d_t`` with ``d = old - rollout`` (no gradient)."""
    d = torch.where(mask, old_logprobs.detach() - rollout_logprobs, 0.0)
    if level == "token":
        return d
    row = d.sum(1, keepdim=True)  # [B, 1]
    if level == "geometric":
        row = row / mask.sum(1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"algorithm.mismatch has levels {list(MISMATCH_LEVELS)}, got {level!r}")
    return torch.where(mask, row.expand_as(d), 0.0)


def mismatch_level_weights(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    mode: str,
    lower: float | None = None,
    upper: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One level's ``(weights [B, T], kept [B, T])`` from its ``log_ratio`` (``r = exp(log_ratio)``):
    truncate ``w = min(r, upper)``; mask ``w = r`` inside [lower, upper], 0 (and not kept) outside;
    reject ``w = 1``, the whole row 0 (not kept) when any of its ratios is outside. A null bound is
    open. Weights are 0 where ``mask`` is False."""
    ratio = torch.where(mask, torch.exp(log_ratio.clamp(-MISMATCH_LOG_CLAMP, MISMATCH_LOG_CLAMP)), 0.0)
    if mode == "truncate":
        assert upper is not None, "truncate needs an upper bound (MismatchConfig checks it)"
        return ratio.clamp(max=upper), mask.clone()
    outside = torch.zeros_like(mask)
    if lower is not None:
        outside |= ratio < lower
    if upper is not None:
        outside |= ratio > upper
    outside &= mask
    if mode == "mask":
        kept = mask & ~outside
        return torch.where(kept, ratio, 0.0), kept
    if mode == "reject":
        kept = mask & ~outside.any(1, keepdim=True)
        return kept.to(ratio.dtype), kept
    raise ValueError(f"algorithm.mismatch.<level>.mode must be truncate, mask or reject here, got {mode!r}")


@dataclass
class MismatchCorrection:
    """``weights [B, T]`` (None: every level off), ``kept [B, T]`` (response tokens no level masked or
    rejected), ``truncated [B, T]`` (tokens some truncating level capped), ``ratio [B, T]`` (raw token
    ratios ``exp(d_t)``, 0 at padding)."""

    weights: Tensor | None
    kept: Tensor
    truncated: Tensor
    ratio: Tensor


def mismatch_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: MismatchConfig
) -> MismatchCorrection:
    """Every level of ``cfg`` that is not off, weights multiplied (no gradient)."""
    token = mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, level="token")
    ratio = torch.where(mask, torch.exp(token.clamp(-MISMATCH_LOG_CLAMP, MISMATCH_LOG_CLAMP)), 0.0)
    weights, kept, truncated = None, mask.clone(), torch.zeros_like(mask)
    for name in MISMATCH_LEVELS:
        level = getattr(cfg, name)
        if level.mode == "off":
            continue
        log_ratio = (
            token if name == "token" else mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, level=name)
        )
        w, k = mismatch_level_weights(log_ratio, mask, mode=level.mode, lower=level.lower, upper=level.upper)
        weights = w if weights is None else weights * w
        kept &= k
        if level.mode == "truncate":
            truncated |= mask & (
                torch.exp(log_ratio.clamp(-MISMATCH_LOG_CLAMP, MISMATCH_LOG_CLAMP)) > level.upper
            )
    return MismatchCorrection(weights=weights, kept=kept, truncated=truncated, ratio=ratio)


def mismatch_row_sums(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, kept: Tensor) -> Tensor:
    """``[B, 6]`` float64 per-row sums, columns ``MISMATCH_SUMS``: response tokens; ``sum_t d_t``;
    ``sum_t k3_t`` with ``k3 = exp(d) - 1 - d`` (Schulman's k3 estimate of KL(mu || pi) from tokens
    sampled by mu, >= 0; verl's ``rollout_corr`` k3 KL); tokens not kept; 1 for a row with tokens; 1 for
    such a row with no token kept (rejected, or every token masked)."""
    d = mismatch_log_ratio(old_logprobs, rollout_logprobs, mask, level="token")
    d = d.double().clamp(-MISMATCH_LOG_CLAMP, MISMATCH_LOG_CLAMP)  # float64: sums of ~1e-9 terms
    # expm1 and the clamp: exp(d) - 1 - d rounds to tiny negatives for |d| ~ 1e-8 (on-policy)
    k3 = torch.where(mask, (torch.expm1(d) - d).clamp(min=0), 0.0)
    has_tokens = mask.any(1)
    return torch.stack(
        [
            mask.sum(1).to(d.dtype),
            d.sum(1),
            k3.sum(1),
            (mask & ~kept).sum(1).to(d.dtype),
            has_tokens.to(d.dtype),
            (has_tokens & ~(kept & mask).any(1)).to(d.dtype),
        ],
        dim=1,
    )


def mismatch_metrics(sums: Tensor) -> dict[str, float]:
    """The mismatch of a set of rows from their summed ``mismatch_row_sums`` (``[6]``): ``mismatch_kl``
    (token mean of k3), ``mismatch_ppl_ratio`` = training PPL / rollout PPL = ``exp(-mean_t d_t)``,
    ``mismatch_masked_frac`` (share of tokens not kept), ``mismatch_rejected_frac`` (share of rows with
    tokens of which none was kept)."""
    tokens, log_ratio, k3, dropped, sequences, rejected = (float(x) for x in sums.tolist())
    num_tokens, num_seqs = max(tokens, 1.0), max(sequences, 1.0)
    return {
        "mismatch_kl": k3 / num_tokens,
        "mismatch_ppl_ratio": math.exp(-log_ratio / num_tokens),
        "mismatch_masked_frac": dropped / num_tokens,
        "mismatch_rejected_frac": rejected / num_seqs,
    }
