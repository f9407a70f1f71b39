"""Driver-side preparation of collected samples for the update, in one call
(``prepare_rollout``): collate, reward shaping, dynamic sampling (with DAPO's refill), advantages
and the per-agent metrics, in that order (``prepare_batch`` is the part after collating).

Each step asks the estimator's registry entry (``estimator_traits``) what it needs instead of
keeping lists of names: ``team_reward_once`` keeps the team reward on an episode's last step only
(an episode whose last step was dropped is dropped whole, ``complete_episodes``); ``group_key`` is
what dynamic sampling filters on, reading the estimator's own advantages (all exactly 0: dropped).
Per-policy algorithms (``policy_algos``) shape and normalise each policy's rows with its own
estimator; a critic policy's rows get placeholder zeros its worker replaces. Refill (DAPO) rolls out
fresh chunks (``draw(round)``) until ``num_tasks`` tasks are informative or
``algorithm.max_refill_rounds`` ran; then ``algorithm.refill_exhausted`` trains on what is left or
stops (``RefillExhaustedError``). Details: docs/design-notes.md, "megamarl/rl/prepare.py".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megamarl.errors import RefillExhaustedError, RolloutFailureError
from megamarl.rl.advantages import advantage_config, compute_advantages, estimator_traits, group_ids
from megamarl.rl.batch import SampleBatch, collate, concat
from megamarl.rl.batch_metrics import agent_batch_metrics, success_metrics
from megamarl.rl.rewards import RewardConfig, dynamic_sampling_mask, last_step_mask, shape_rewards
from megamarl.rl.sample import Sample

if TYPE_CHECKING:  # config.py imports the estimator registry through this package: no run-time cycle
    from megamarl.config import AlgorithmConfig

Draw = Callable[[int], "SampleBatch | None"]  # refill round (1, 2, ...) -> a fresh batch, or None


def complete_episodes(samples: Sequence[Sample]) -> tuple[list[Sample], int]:
    """``(kept, num_dropped)``: the samples of every episode that still holds its last step
    (``Sample.episode_last_step``, stamped when the episode finished); an episode missing it is
    dropped whole. Samples that carry no stamp (built outside the rollout) count as complete."""
    last_present: dict[str, int] = {}
    for s in samples:
        last_present[s.episode_id] = max(last_present.get(s.episode_id, s.step), s.step)
    incomplete = {
        s.episode_id
        for s in samples
        if s.episode_last_step is not None and last_present[s.episode_id] < s.episode_last_step
    }
    return [s for s in samples if s.episode_id not in incomplete], len(incomplete)


PolicyAlgos = Mapping[
    str, "AlgorithmConfig"
]  # policy -> its algorithm settings (RunConfig.policy_algorithms)


def _policy_rows(batch: SampleBatch, algos: PolicyAlgos) -> list[tuple[torch.Tensor, AlgorithmConfig]]:
    """``(rows [B] bool, settings)`` of each policy present in ``batch``, in vocab order."""
    present = set(batch.policy.tolist())
    return [(batch.policy == i, algos[name]) for i, name in enumerate(batch.vocab["policy"]) if i in present]


def shaped_rewards(
    batch: SampleBatch, algo: AlgorithmConfig, policy_algos: PolicyAlgos | None = None
) -> torch.Tensor:
    """``[B]`` rewards the estimator consumes (see ``megamarl.rl.rewards``); with ``policy_algos``,
    each policy's rows shaped with its own settings (over the whole batch: episodes span policies)."""
    if policy_algos:
        out = torch.zeros_like(batch.rewards)
        for rows, own in _policy_rows(batch, policy_algos):
            out = torch.where(rows, shaped_rewards(batch, own), out)
        return out
    index = batch.group_index()
    team_mask = None
    if estimator_traits(algo.estimator).team_reward_once:
        team_mask = last_step_mask(group_ids(index, ("task", "episode")), batch.step)
    cfg = RewardConfig(
        alpha=algo.team_alpha, turn_gamma=algo.turn_gamma, invalid_penalty=algo.invalid_penalty
    )
    return shape_rewards(
        batch.team_rewards,
        batch.local_rewards,
        valid=batch.valid,
        seq_ids=group_ids(index, ("task", "episode", "agent")),
        turns=batch.turn,
        cfg=cfg,
        team_mask=team_mask,
    )


def dynamic_sampling_key(algo: AlgorithmConfig) -> tuple[str, ...]:
    """The group key dynamic sampling filters by: the estimator's own."""
    return estimator_traits(algo.estimator).key(algo.group_by)


def informative_mask(batch: SampleBatch, algo: AlgorithmConfig) -> tuple[torch.Tensor, int]:
    """``(keep [B], num_dropped_groups)``: dynamic sampling's filter on ``batch`` (rewards shaped):
    groups of the estimator's key whose advantages, as the estimator computes them, are all 0."""
    gid = group_ids(batch.group_index(), dynamic_sampling_key(algo))
    return dynamic_sampling_mask(batch_advantages(batch, algo), gid)


def informative_tasks(batch: SampleBatch, keep: torch.Tensor) -> list[int]:
    """Task ids (batch vocab indices) with at least one kept row, in first-appearance order."""
    return list(dict.fromkeys(batch.task[keep].tolist()))


def fill_informative(
    batch: SampleBatch,
    draw: Draw,
    algo: AlgorithmConfig,
    *,
    num_tasks: int,
) -> tuple[SampleBatch, dict[str, float]]:
    """Dynamic sampling with refill (module docstring). ``batch.rewards`` must be shaped; so must
    the batches ``draw`` returns. When no group is informative the batch is returned whole (its
    advantages are all 0, but every rank still takes part in the update)."""
    keep, num_dropped = informative_mask(batch, algo)
    rounds = 0
    while len(informative_tasks(batch, keep)) < num_tasks and rounds < algo.max_refill_rounds:
        rounds += 1
        extra = draw(rounds)
        if extra is not None and extra.num_samples:
            batch = concat([batch, extra])
            keep, num_dropped = informative_mask(batch, algo)
    found = informative_tasks(batch, keep)
    exhausted = algo.max_refill_rounds > 0 and len(found) < num_tasks
    if exhausted and algo.refill_exhausted == "stop":
        raise RefillExhaustedError(
            f"dynamic sampling: {len(found)} of rollout.num_tasks={num_tasks} tasks informative after "
            f"algorithm.max_refill_rounds={algo.max_refill_rounds} refill rounds, and "
            f"algorithm.refill_exhausted=stop (set it to train to go on with what is left)"
        )
    tasks = found[:num_tasks] if rounds else found
    keep = keep & torch.isin(batch.task, torch.tensor(tasks, dtype=batch.task.dtype))
    metrics = {
        "rollout/dropped_groups": float(num_dropped),
        "rollout/refill_rounds": float(rounds),
        "rollout/informative_tasks": float(len(tasks)),
    }
    if algo.max_refill_rounds > 0:
        metrics["rollout/refill_exhausted"] = float(exhausted)
    return (batch.select(keep) if keep.any() else batch), metrics


def batch_advantages(
    batch: SampleBatch,
    algo: AlgorithmConfig,
    policy_algos: PolicyAlgos | None = None,
) -> torch.Tensor | None:
    """Advantages of ``batch`` (rewards shaped); None for critic estimators (GAE runs on the workers).
    With ``policy_algos``, each policy's by its own estimator over its own rows (module docstring)."""
    if policy_algos:
        return _per_policy_advantages(batch, policy_algos)
    if estimator_traits(algo.estimator).needs_critic:
        return None
    return compute_advantages(
        batch.rewards, batch.group_index(), advantage_config(algo), response_mask=batch.response_mask
    )


def _per_policy_advantages(batch: SampleBatch, policy_algos: PolicyAlgos) -> torch.Tensor | None:
    """``[B]`` or (when some estimator is per token) ``[B, T]`` advantages, each policy's rows from its
    own estimator on its own rows; zeros for critic-estimator policies; None when every policy present
    uses a critic estimator."""
    parts = []
    for rows, own in _policy_rows(batch, policy_algos):
        adv = batch_advantages(batch.select(rows), own)
        parts.append((rows, adv))
    if all(adv is None for _, adv in parts):
        return None
    per_token = any(adv is not None and adv.dim() == 2 for _, adv in parts)
    dtype = next(adv.dtype for _, adv in parts if adv is not None)
    out = torch.zeros(batch.response_mask.shape if per_token else batch.rewards.shape, dtype=dtype)
    for rows, adv in parts:
        if adv is None:
            continue
        if not per_token:
            out[rows] = adv.to(dtype)
            continue
        if adv.dim() == 1:  # a sample's advantage on each of its tokens (the loss masks the rest)
            adv = adv[:, None].expand(-1, out.shape[1])
        out[rows, : adv.shape[1]] = adv.to(dtype)  # a policy's rows may be narrower (select trims padding)
    return out


def prepare_batch(
    batch: SampleBatch,
    algo: AlgorithmConfig,
    *,
    num_tasks: int,
    draw: Draw,
    policy_algos: PolicyAlgos | None = None,
) -> tuple[SampleBatch, dict[str, float]]:
    """Shape rewards, apply dynamic sampling (+ refill) when ``algo.dynamic_sampling``, set advantages.
    ``draw`` returns *unshaped* collated batches; they are shaped here. ``policy_algos``: per-policy
    settings (module docstring; not with dynamic sampling)."""
    if policy_algos:
        batch = batch.replace(rewards=shaped_rewards(batch, algo, policy_algos))
        return batch.replace(advantages=batch_advantages(batch, algo, policy_algos)), {}
    batch = batch.replace(rewards=shaped_rewards(batch, algo))
    metrics: dict[str, float] = {}
    if algo.dynamic_sampling:

        def shaped_draw(round_: int) -> SampleBatch | None:
            extra = draw(round_)
            return None if extra is None else extra.replace(rewards=shaped_rewards(extra, algo))

        batch, metrics = fill_informative(batch, shaped_draw, algo, num_tasks=num_tasks)
    return batch.replace(advantages=batch_advantages(batch, algo)), metrics


def prepare_rollout(
    samples: Sequence[Sample],
    episodes: Iterable,
    algo: AlgorithmConfig,
    *,
    pad_id: int | Mapping[str, int],
    num_tasks: int,
    draw: Draw,
    policy_algos: PolicyAlgos | None = None,
) -> tuple[SampleBatch, dict[str, float]]:
    """Collected samples -> the training batch and its metrics, in one call: (for ``team_reward_once``
    estimators) drop episodes that lost their last step, collate (``pad_id``: as ``batch.collate``, one
    id or each policy's own), ``prepare_batch`` (shaping, dynamic
    sampling with refill, advantages), then the per-agent batch statistics and each agent's and
    policy's own success over the finished ``episodes``. ``policy_algos``: per-policy settings, given
    when some policy has its own (module docstring)."""
    num_incomplete = 0
    every = list(policy_algos.values()) if policy_algos else [algo]
    once = any(estimator_traits(a.estimator).team_reward_once for a in every)
    if once:
        samples, num_incomplete = complete_episodes(samples)
        if not samples:
            raise RolloutFailureError(
                f"every episode of the batch lost its last-step samples before preparation "
                f"({num_incomplete} episodes); algorithm.estimator={algo.estimator!r} "
                f"places the team reward on that step"
            )
    batch, metrics = prepare_batch(
        collate(samples, pad_id=pad_id), algo, num_tasks=num_tasks, draw=draw, policy_algos=policy_algos
    )
    if once:
        metrics["rollout/dropped_incomplete_episodes"] = float(num_incomplete)
    metrics.update(agent_batch_metrics(batch))
    for rows, own in _policy_rows(batch, policy_algos) if policy_algos else []:
        if estimator_traits(own.estimator).needs_critic:  # placeholders: the worker's critic sets them
            for agent in {batch.names("agent")[i] for i in rows.nonzero().flatten().tolist()}:
                metrics.pop(f"agent/{agent}/advantage_mean", None)
                metrics.pop(f"agent/{agent}/advantage_std", None)
    metrics.update(success_metrics(e for e in episodes if e.status == "ok"))
    return batch, metrics
