"""Driver-side preparation of collected samples for the update, in one call
(``prepare_rollout``): collate, reward shaping, dynamic sampling (with DAPO's refill), advantages
and the per-agent metrics, in that order (``prepare_batch`` is the part after collating).

Each step asks the estimator's registry entry (``estimator_traits``) what it needs instead of
keeping lists of names:

* ``team_reward_once``: the estimator sums rewards along an episode (GiGPO), so the team reward
  stays on the episode's last step only (``rewards.last_step_mask``);
* ``group_key``: dynamic sampling drops the groups *the estimator normalises over* whose rewards are
  all equal (for Dr.MAS that is (task, agent), not ``algorithm.group_by``); a group it would keep has
  a non-zero advantage somewhere.

Refill (DAPO): while fewer than ``num_tasks`` tasks have an informative group and fewer than
``algorithm.max_refill_rounds`` extra rounds ran, ``draw(round)`` rolls out a fresh chunk of tasks
(unique task ids, so groups of two rounds never merge); the informative tasks beyond ``num_tasks``
are trimmed, first drawn kept. The number of extra rounds is logged as ``rollout/refill_rounds``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from megamarl.rl.advantages import AdvantageConfig, compute_advantages, estimator_traits, group_ids
from megamarl.rl.batch import SampleBatch, collate, concat
from megamarl.rl.rewards import RewardConfig, dynamic_sampling_mask, last_step_mask, shape_rewards
from megamarl.rl.sample import Sample
from megamarl.runtime.step_metrics import agent_batch_metrics, success_metrics

if TYPE_CHECKING:  # config.py imports the estimator registry through this package: no run-time cycle
    from megamarl.config import AlgorithmConfig

Draw = Callable[[int], "SampleBatch | None"]  # refill round (1, 2, ...) -> a fresh batch, or None


def shaped_rewards(batch: SampleBatch, algo: AlgorithmConfig) -> torch.Tensor:
    """``[B]`` rewards the estimator consumes (see ``megamarl.rl.rewards``)."""
    index = batch.group_index()
    team_mask = None
    if estimator_traits(algo.estimator).team_reward_once:
        team_mask = last_step_mask(group_ids(index, ("task", "episode")), batch.step)
    cfg = RewardConfig(alpha=algo.team_alpha, turn_gamma=algo.turn_gamma, invalid_penalty=algo.invalid_penalty)
    return shape_rewards(batch.team_rewards, batch.local_rewards, valid=batch.valid,
                         seq_ids=group_ids(index, ("task", "episode", "agent")), turns=batch.turn,
                         cfg=cfg, team_mask=team_mask)


def dynamic_sampling_key(algo: AlgorithmConfig) -> tuple[str, ...]:
    """The group key dynamic sampling filters by: the estimator's own."""
    return estimator_traits(algo.estimator).key(algo.group_by)


def informative_tasks(batch: SampleBatch, keep: torch.Tensor) -> list[int]:
    """Task ids (batch vocab indices) with at least one kept row, in first-appearance order."""
    return list(dict.fromkeys(batch.task[keep].tolist()))


def fill_informative(
    batch: SampleBatch, draw: Draw, *, key: tuple[str, ...], num_tasks: int, max_rounds: int,
) -> tuple[SampleBatch, dict[str, float]]:
    """Dynamic sampling with refill (module docstring). ``batch.rewards`` must be shaped; so must
    the batches ``draw`` returns. When no group is informative the batch is returned whole (its
    advantages are all 0, but every rank still takes part in the update)."""
    keep, num_dropped = dynamic_sampling_mask(batch.rewards, group_ids(batch.group_index(), key))
    rounds = 0
    while len(informative_tasks(batch, keep)) < num_tasks and rounds < max_rounds:
        rounds += 1
        extra = draw(rounds)
        if extra is not None and extra.num_samples:
            batch = concat([batch, extra])
            keep, num_dropped = dynamic_sampling_mask(batch.rewards, group_ids(batch.group_index(), key))
    tasks = informative_tasks(batch, keep)[:num_tasks] if rounds else informative_tasks(batch, keep)
    keep = keep & torch.isin(batch.task, torch.tensor(tasks, dtype=batch.task.dtype))
    metrics = {"rollout/dropped_groups": float(num_dropped), "rollout/refill_rounds": float(rounds),
               "rollout/informative_tasks": float(len(tasks))}
    return (batch.select(keep) if keep.any() else batch), metrics


def batch_advantages(batch: SampleBatch, algo: AlgorithmConfig) -> torch.Tensor | None:
    """Advantages of ``batch`` (rewards shaped); None for critic estimators (GAE runs on the workers)."""
    if estimator_traits(algo.estimator).needs_critic:
        return None
    cfg = AdvantageConfig(estimator=algo.estimator, group_by=list(algo.group_by), norm_std=algo.normalize_std,
                          std_ddof=algo.std_ddof, **algo.estimator_kwargs)
    return compute_advantages(batch.rewards, batch.group_index(), cfg, response_mask=batch.response_mask)


def prepare_batch(
    batch: SampleBatch, algo: AlgorithmConfig, *, num_tasks: int, draw: Draw,
) -> tuple[SampleBatch, dict[str, float]]:
    """Shape rewards, apply dynamic sampling (+ refill) when ``algo.dynamic_sampling``, set advantages.
    ``draw`` returns *unshaped* collated batches; they are shaped here."""
    batch = batch.replace(rewards=shaped_rewards(batch, algo))
    metrics: dict[str, float] = {}
    if algo.dynamic_sampling:
        def shaped_draw(round_: int) -> SampleBatch | None:
            extra = draw(round_)
            return None if extra is None else extra.replace(rewards=shaped_rewards(extra, algo))

        batch, metrics = fill_informative(batch, shaped_draw, key=dynamic_sampling_key(algo), num_tasks=num_tasks,
                                          max_rounds=algo.max_refill_rounds)
    return batch.replace(advantages=batch_advantages(batch, algo)), metrics


def prepare_rollout(
    samples: Sequence[Sample], episodes: Iterable, algo: AlgorithmConfig, *, pad_id: int, num_tasks: int,
    draw: Draw,
) -> tuple[SampleBatch, dict[str, float]]:
    """Collected samples -> the training batch and its metrics, in one call: collate, ``prepare_batch``
    (shaping, dynamic sampling with refill, advantages), then the per-agent batch statistics and each
    agent's and policy's own success over the finished ``episodes``."""
    batch, metrics = prepare_batch(collate(samples, pad_id=pad_id), algo, num_tasks=num_tasks, draw=draw)
    metrics.update(agent_batch_metrics(batch))
    metrics.update(success_metrics(e for e in episodes if e.status == "ok"))
    return batch, metrics

