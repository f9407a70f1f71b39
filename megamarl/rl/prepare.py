"""Collected samples -> one training batch, in one call: collate, reward shaping, dynamic sampling,
advantages and the per-agent metrics.

``prepare_batch(samples, algo, pad_id=...)`` is the whole of step 3 of DESIGN.md's loop ("prepare"),
on the driver's gathered batch. ``AlgorithmConfig`` (the ``algorithm:`` config section) is defined
here, next to the code that reads it. Estimators that need a critic (``EstimatorTraits.needs_critic``)
are left to each policy's workers (their advantages need the critic's values); the batch leaves
here with ``advantages=None`` for them.

How it differs from a single-agent pipeline: every group statistic (reward-shaping sequences,
dynamic-sampling groups, advantage groups) is keyed by the batch's index columns, so the agent and
turn of each sample decide what it is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages, group_ids
from megamarl.rl.batch import SampleBatch, collate
from megamarl.rl.rewards import RewardConfig, dynamic_sampling_mask, shape_rewards
from megamarl.rl.sample import Sample


@dataclass
class AlgorithmConfig:
    """``algorithm:``: the advantage estimator and its group key, reward shaping, dynamic sampling,
    and the loss knobs shared by every policy (aggregation, KL estimator, truncated IS cap)."""

    estimator: str = "at_grpo"
    group_by: list[str] = field(default_factory=lambda: ["task", "agent", "turn"])
    normalize_std: bool = True
    team_alpha: float = 1.0  # reward = team + alpha * local
    turn_gamma: float = 1.0
    invalid_penalty: float = 0.0
    dynamic_sampling: bool = False
    loss_agg: str = "token-mean"
    kl_type: str = "k3"
    tis_cap: float = 2.0  # truncated IS cap (rollout vs training logprobs); 0 disables
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(estimator=self.estimator, group_by=list(self.group_by), norm_std=self.normalize_std,
                               **self.estimator_kwargs)

    def reward_config(self) -> RewardConfig:
        return RewardConfig(alpha=self.team_alpha, turn_gamma=self.turn_gamma, invalid_penalty=self.invalid_penalty)


def prepare_batch(
    samples: Sequence[Sample], algo: AlgorithmConfig, *, pad_id: int,
) -> tuple[SampleBatch, dict[str, float]]:
    """The training batch of ``samples`` and its metrics (``rollout/dropped_groups`` with dynamic
    sampling, ``agent/<a>/*``). When dynamic sampling would drop every group the batch is kept whole
    (the advantages of zero-variance groups are 0: the step trains on nothing but does not fail)."""
    batch = collate(samples, pad_id=pad_id)
    index = batch.group_index()
    rewards = shape_rewards(
        batch.team_rewards, batch.local_rewards, valid=batch.valid,
        seq_ids=group_ids(index, ("task", "episode", "agent")), turns=batch.turn, cfg=algo.reward_config(),
    )
    batch = batch.replace(rewards=rewards)
    metrics: dict[str, float] = {}
    if algo.dynamic_sampling:
        keep, num_dropped = dynamic_sampling_mask(batch.rewards, group_ids(index, tuple(algo.group_by)))
        metrics["rollout/dropped_groups"] = float(num_dropped)
        if keep.any():
            batch = batch.select(keep)
    if not ADVANTAGE_ESTIMATORS.traits(algo.estimator, key="algorithm.estimator").needs_critic:
        batch = batch.replace(advantages=compute_advantages(batch.rewards, batch.group_index(), algo.advantage_config()))
    metrics.update(per_agent_metrics(batch))
    return batch, metrics


def per_agent_metrics(batch: SampleBatch) -> dict[str, float]:
    """``agent/<a>/{reward_mean, response_len, invalid_rate, num_samples, success}`` over the batch."""
    out = {}
    names = batch.names("agent")
    lengths = batch.response_mask.sum(1).float()
    for agent in sorted(set(names)):
        rows = torch.tensor([n == agent for n in names])
        out[f"agent/{agent}/reward_mean"] = float(batch.rewards[rows].mean())
        out[f"agent/{agent}/response_len"] = float(lengths[rows].mean())
        out[f"agent/{agent}/invalid_rate"] = float((~batch.valid[rows]).float().mean())
        out[f"agent/{agent}/num_samples"] = float(rows.sum())
        out[f"agent/{agent}/success"] = float((batch.team_rewards[rows] > 0).float().mean())
    return out
