"""Policy-gradient losses as pure tensor functions, composed by ``policy_loss`` under a ``LossConfig``.

Three log-probabilities of each response token meet here:
  * ``logprobs``: the policy being trained (carries the gradient);
  * ``old_logprobs``: the proximal policy the PPO ratio is taken against, recomputed by the trainer
    before the update; None means on-policy, ``old = logprobs.detach()`` (ratio 1);
  * ``rollout_logprobs``: what the inference engine (vLLM/SGLang) reported when sampling. Engine and
    trainer numerics differ, and in async modes the engine's weights are stale, so the PPO term is
    reweighted by the mismatch correction of ``megamarl.rl.mismatch`` (no gradient; by default the
    truncated importance weight ``min(pi_old / pi_rollout, 2)``).

Unlike the textbook PPO loss, masked (padding / prompt) positions are replaced by 0 *before* any
arithmetic, so garbage or NaN in padding can reach neither the loss nor its gradient.
Shapes: ``[B, T]`` token tensors with a boolean ``response_mask [B, T]``; advantages ``[B]`` or ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from megamarl.config_sections import MismatchConfig
from megamarl.registry import Registry
from megamarl.rl.mismatch import mismatch_correction, mismatch_row_sums

LOG_RATIO_CLAMP = 20.0  # exp(+-20) is finite in fp32; beyond it ratios are meaningless anyway
# k3 grows like exp(-d): at d = log pi - log pi_ref = -15 it is 3.3e6, and so is its gradient, which one
# token can then dominate a batch with. Clamped like verl's low_var_kl: beyond it, no gradient.
KL_K3_CLAMP = 10.0


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, x.new_zeros(()))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask``; 0 for an empty mask."""
    return _masked(x, mask).sum() / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------
# from logits


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 4096,
) -> Tensor:
    """``out[b, t] = log softmax(logits[b, t-1] / temperature)[tokens[b, t]]``, ``out[:, 0] = 0``.

    Aligned with ``SampleBatch.tokens``: the value at t is the logprob of ``tokens[t]`` (logits at t-1
    predict token t). Computed as ``z[token] - logsumexp(z)`` in fp32, ``chunk_rows`` rows at a time,
    so no full ``[B, T, V]`` log-softmax is materialised. ``temperature`` must match the sampler's.
    """
    b, t, v = logits.shape
    z = logits[:, :-1].reshape(-1, v)  # [B*(T-1), V]
    target = tokens[:, 1:].reshape(-1)  # [B*(T-1)]
    parts = []
    for start in range(0, z.shape[0], chunk_rows):
        zc = z[start : start + chunk_rows].float() / temperature
        picked = zc.gather(1, target[start : start + chunk_rows, None]).squeeze(1)
        parts.append(picked - torch.logsumexp(zc, dim=-1))
    out = torch.cat(parts) if parts else z.new_zeros(0, dtype=torch.float32)
    return torch.cat([out.new_zeros(b, 1), out.view(b, t - 1)], dim=1)


def entropy_from_logits(logits: Tensor, *, chunk_rows: int = 4096) -> Tensor:
    """Per-token entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of ``logits [B, T, V]`` -> ``[B, T]``.

    fp32, ``chunk_rows`` rows at a time (bounds the temporaries; under autograd each chunk's softmax is
    still kept for backward, so compute it under ``no_grad`` when only logging).
    """
    b, t, v = logits.shape
    z = logits.reshape(-1, v)
    parts = []
    for start in range(0, z.shape[0], chunk_rows):
        zc = z[start : start + chunk_rows].float()
        parts.append(torch.logsumexp(zc, dim=-1) - (torch.softmax(zc, dim=-1) * zc).sum(-1))
    return (torch.cat(parts) if parts else z.new_zeros(0, dtype=torch.float32)).view(b, t)


# --------------------------------------------------------------------------------------------
# PPO surrogate


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped surrogate per token: returns ``(loss [B, T], clipped [B, T], dual_clipped [B, T])``.

    ``rho = exp(logprobs - old_logprobs)``;
    ``L = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))``;
    dual clip (A < 0 only): ``L = min(L, -dual_clip * A)`` bounds the loss of very large ratios.
    ``ratio_level="sequence"`` (GSPO-token): every token of a row uses the row's ratio
    ``exp(mean_t(logprobs - old_logprobs))`` as value, with the gradient of its own token
    (``rho_t = sg[rho_seq] * pi_t / sg[pi_t]``).
    """
    adv = _masked(advantages[:, None] if advantages.dim() == 1 else advantages, mask)  # [B, T]
    log_ratio = _masked(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if ratio_level == "sequence":
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = _masked(logprobs - logprobs.detach() + seq.detach(), mask)
    elif ratio_level != "token":
        raise ValueError(f"loss.ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = (surr_clipped > surr) & mask
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual_clipped = (adv < 0) & (loss > bound) & mask
        loss = torch.where(dual_clipped, bound, loss)
    return _masked(loss, mask), clipped, dual_clipped


# --------------------------------------------------------------------------------------------
# KL to the reference policy

KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry(
    "kl estimator",
    signature="fn(logprobs [B, T], ref_logprobs [B, T]) -> [B, T] (0 where equal)",
    keys=("algorithm.kl_type",),
)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``k1 = d``, ``d = log pi - log pi_ref`` (unbiased, can be negative)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``k2 = d^2 / 2``."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``k3 = min(exp(-d) - 1 + d, KL_K3_CLAMP)`` (>= 0; Schulman's estimator with r = pi_ref / pi,
    clamped at 10 so a token far from the reference gives a bounded loss and no gradient)."""
    d = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-d) - 1 + d).clamp(-KL_K3_CLAMP, KL_K3_CLAMP)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, kind: str = "k3") -> Tensor:
    """Per-token KL estimate ``[B, T]`` of type ``kind`` (k1, k2, k3), 0 where ``mask`` is False."""
    fn = KL_ESTIMATORS.get(kind, key="loss.kl_type")
    return _masked(fn(_masked(logprobs, mask), _masked(ref_logprobs, mask)), mask)


# --------------------------------------------------------------------------------------------
# critic


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token (PPO critic): returns ``(loss [B, T], clipped [B, T])``.

    ``v_c = old + clamp(v - old, -clip, clip)``; ``L = 0.5 * max((v - R)^2, (v_c - R)^2)``
    (``clip=None``: ``0.5 * (v - R)^2``). 0 where ``mask`` is False.
    """
    mask = mask.bool()
    v, ret = _masked(values, mask), _masked(returns, mask)
    unclipped = (v - ret) ** 2
    if clip is None:
        return _masked(0.5 * unclipped, mask), torch.zeros_like(mask)
    old = _masked(old_values, mask)
    v_clipped = old + (v - old).clamp(-clip, clip)
    clipped_sq = (v_clipped - ret) ** 2
    return _masked(0.5 * torch.maximum(unclipped, clipped_sq), mask), (clipped_sq > unclipped) & mask


# --------------------------------------------------------------------------------------------
# aggregation: token losses [B, T] -> scalar
#
# ``num_tokens`` / ``num_seqs`` are the counts of the whole mini-batch when it is split into
# micro-batches for gradient accumulation: summing the micro-batch losses then equals the loss of the
# whole mini-batch. Left None, the counts of the given tensors are used.

LOSS_AGGREGATIONS: Registry[Callable[..., Tensor]] = Registry(
    "loss aggregation",
    signature="fn(loss [B, T], mask [B, T], *, num_tokens=None, num_seqs=None) -> scalar",
    keys=(
        "algorithm.loss_agg",
        "algorithm.value_loss_agg",
        "policies.<name>.algorithm.loss_agg",
        "policies.<name>.algorithm.value_loss_agg",
    ),
)


def loss_counts(response_mask: Tensor) -> dict[str, int]:
    """``num_tokens`` / ``num_seqs`` of a whole mini-batch for the aggregations below. A row without
    response tokens (e.g. a prompt that hit the length limit) is not a sequence of the mean."""
    mask = response_mask.bool()
    return {"num_tokens": int(mask.sum()), "num_seqs": int(mask.any(1).sum())}


@LOSS_AGGREGATIONS.register("token-mean")
def agg_token_mean(loss: Tensor, mask: Tensor, *, num_tokens: int | None = None, num_seqs: int | None = None):
    """``sum_{b,t} m L / sum_{b,t} m``: every token weighs the same (DAPO)."""
    denom = mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
    return _masked(loss, mask).sum() / denom


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def agg_seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, num_tokens: int | None = None, num_seqs: int | None = None
):
    """``(1/S) sum_b sum_t m L``: long responses weigh more (Dr.GRPO without its constant)."""
    denom = mask.any(1).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1)
    return _masked(loss, mask).sum() / denom


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def agg_seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: int | None = None, num_seqs: int | None = None
):
    """``(1/S) sum_b (sum_t m L / sum_t m)``: every sequence weighs the same (original GRPO)."""
    per_seq = _masked(loss, mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    denom = mask.any(1).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1)
    return per_seq.sum() / denom


# --------------------------------------------------------------------------------------------
# composition


@dataclass
class LossConfig:
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound 1 + clip_high (DAPO clip-higher: e.g. 0.28)
    dual_clip: float | None = 3.0  # None: off; else > 1, bounds the loss for negative advantages
    ratio_level: str = "token"  # token | sequence (GSPO)
    kl_coef: float = 0.0
    kl_type: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0
    agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    # rollout vs training log-probs (megamarl.rl.mismatch); every level off: no correction
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"loss.clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"loss.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"loss.dual_clip must be None or > 1, got {self.dual_clip}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"loss.ratio_level must be 'token' or 'sequence', got {self.ratio_level!r}")
        for key in ("kl_coef", "entropy_coef"):
            if getattr(self, key) < 0:
                raise ValueError(f"loss.{key} must be >= 0, got {getattr(self, key)}")
        KL_ESTIMATORS.get(self.kl_type, key="loss.kl_type")
        LOSS_AGGREGATIONS.get(self.agg_mode, key="loss.agg_mode")


@dataclass
class LossMetrics:
    """Detached 0-d tensors (no device sync until ``as_dict``); None = not computed.

    Token statistics are masked token means over the given tensors: ``clip_frac``/``dual_clip_frac``
    fraction of tokens clipped; ``approx_kl`` mean k3(pi, pi_old); ``entropy`` mean entropy;
    ``tis_weight_mean`` mean *applied* mismatch weight (every level's, multiplied), ``tis_weight_max``
    max *raw* token ratio, ``tis_clip_frac`` fraction of tokens a truncating level capped.
    ``mismatch_rows``: ``[B, 6]`` ``mismatch.mismatch_row_sums`` (given rollout log-probs), for
    per-agent metrics; not in ``as_dict``.
    """

    loss: Tensor
    pg_loss: Tensor
    clip_frac: Tensor
    dual_clip_frac: Tensor
    approx_kl: Tensor
    kl_loss: Tensor | None = None
    entropy: Tensor | None = None
    tis_weight_mean: Tensor | None = None
    tis_weight_max: Tensor | None = None
    tis_clip_frac: Tensor | None = None
    mismatch_rows: Tensor | None = None

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "mismatch_rows"}
        return {prefix + name: float(v) for name, v in values.items() if v is not None}


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cfg: LossConfig,
    *,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
) -> tuple[Tensor, LossMetrics]:
    """``loss = agg(w_tis * L_ppo) + kl_coef * agg(KL) - entropy_coef * agg(H)`` with ``agg = cfg.agg_mode``.

    ``ref_logprobs`` is required when ``kl_coef > 0``, ``entropy [B, T]`` when ``entropy_coef > 0``,
    ``rollout_logprobs`` unless every ``cfg.mismatch`` level is off; given anyway, the mismatch is
    measured (``mismatch_rows``).
    """
    mask = response_mask.bool()
    lp = _masked(logprobs, mask)
    old = lp.detach() if old_logprobs is None else _masked(old_logprobs, mask)
    agg = LOSS_AGGREGATIONS.get(cfg.agg_mode, key="loss.agg_mode")
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs}

    pg_tok, clipped, dual_clipped = ppo_clip_loss(
        lp,
        old,
        advantages,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        ratio_level=cfg.ratio_level,
    )
    tis = {}
    if cfg.mismatch.enabled and rollout_logprobs is None:
        raise ValueError("loss.mismatch corrects with rollout_logprobs: pass them (or turn every level off)")
    if rollout_logprobs is not None:
        corr = mismatch_correction(old, rollout_logprobs, mask, cfg.mismatch)
        tis["mismatch_rows"] = mismatch_row_sums(old, rollout_logprobs, mask, corr.kept)
        if corr.weights is not None:
            pg_tok = pg_tok * corr.weights
            tis |= {
                "tis_weight_mean": masked_mean(corr.weights, mask),
                "tis_weight_max": corr.ratio.amax() if corr.ratio.numel() else corr.ratio.sum(),  # 0 if empty
                "tis_clip_frac": masked_mean(corr.truncated.float(), mask),
            }
    pg_loss = agg(pg_tok, mask, **counts)
    total = pg_loss

    kl_loss = None
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if ref_logprobs is not None:
        kl_loss = agg(kl_penalty(lp, ref_logprobs, mask, kind=cfg.kl_type), mask, **counts)
        total = total + cfg.kl_coef * kl_loss
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs entropy")
    if entropy is not None:
        total = total - cfg.entropy_coef * agg(_masked(entropy, mask), mask, **counts)

    metrics = LossMetrics(
        loss=total.detach(),
        pg_loss=pg_loss.detach(),
        clip_frac=masked_mean(clipped.float(), mask),
        dual_clip_frac=masked_mean(dual_clipped.float(), mask),
        approx_kl=masked_mean(kl_k3(lp.detach(), old.detach()), mask),
        kl_loss=None if kl_loss is None else kl_loss.detach(),
        entropy=None if entropy is None else masked_mean(entropy.detach(), mask),
        **{k: v.detach() for k, v in tis.items()},
    )
    return total, metrics
