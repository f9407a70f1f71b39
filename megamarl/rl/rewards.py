"""Reward shaping for agent-tagged samples: pure tensor functions, applied before advantages.

A sample carries the episode's ``team_reward`` and its agent's ``local_reward``; ``shape_rewards``
applies, in order: placement (for estimators that sum along an episode, e.g. GiGPO, the team reward
only on the last step: ``last_step_mask``), mix (``r = team + alpha * local``, ``alpha`` annealed by
``team_alpha_at``), discount (``r <- gamma^(T_last - t) * r`` per (task, episode, agent): it scales the
reward a sample carries, unlike return discounting) and penalty (``+ penalty`` where the action did not
parse, undiscounted). Dynamic sampling (DAPO) is a filter, not shaping: ``dynamic_sampling_mask`` drops
groups (of the estimator's group key) whose advantages are all exactly 0. It reads advantages, not
rewards, so it always agrees with what the estimator compares.
Formulas and each estimator's case: docs/design-notes.md, "megamarl/rl/rewards.py".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megamarl.config import AlgorithmConfig
from megamarl.config_sections import TeamAlphaSchedule
from megamarl.registry import Registry

# progress p in [0, 1] of the schedule -> fraction of the way from start to end
ALPHA_SCHEDULES: Registry[Callable[[float], float]] = Registry(
    "team_alpha schedule",
    signature="shape(progress: float in [0, 1]) -> float, 0 at progress 0 and 1 at 1 (constant: always 0)",
    keys=("algorithm.team_alpha_schedule.kind",),
)
ALPHA_SCHEDULES.add("constant", lambda progress: 0.0)
ALPHA_SCHEDULES.add("linear", lambda progress: progress)
ALPHA_SCHEDULES.add("cosine", lambda progress: 0.5 * (1.0 - math.cos(math.pi * progress)))


def algorithm_at_step(algo: AlgorithmConfig, step: int, *, total_steps: int) -> AlgorithmConfig:
    """``algo`` as trainer ``step`` (0-based) uses it: ``team_alpha`` from its schedule; ``algo``
    itself, the same object, while the weight does not move."""
    schedule = algo.team_alpha_schedule
    alpha = team_alpha_at(
        step,
        start=algo.team_alpha,
        end=schedule.end,
        num_steps=schedule.steps or total_steps,
        kind=schedule.kind,
    )
    return algo if alpha == algo.team_alpha else replace(algo, team_alpha=alpha)


def check_team_alpha_schedule(schedule: TeamAlphaSchedule) -> None:
    """Load time: ``algorithm.team_alpha_schedule.kind`` is a registered shape."""
    ALPHA_SCHEDULES.get(schedule.kind, key="algorithm.team_alpha_schedule.kind")


def team_alpha_at(step: int, *, start: float, end: float, num_steps: int, kind: str) -> float:
    """The local-reward weight at (0-based) trainer ``step``: ``start`` at step 0, ``end`` from step
    ``num_steps`` on, shaped by ``kind`` in between; ``kind=constant`` returns ``start`` exactly."""
    progress = min(step / num_steps, 1.0) if num_steps > 0 else 1.0
    fraction = ALPHA_SCHEDULES.get(kind)(progress)
    return start if fraction == 0.0 else start + (end - start) * fraction


def mix_rewards(team: Tensor, local: Tensor, *, alpha: float) -> Tensor:
    """``r = team + alpha * local`` (all ``[N]``)."""
    return team + alpha * local


def discount_turns(rewards: Tensor, seq_ids: Tensor, turns: Tensor, *, gamma: float) -> Tensor:
    """``r_i * gamma^(T_last(seq_i) - t_i)`` with ``T_last`` the max turn within ``seq_ids`` (``[N]``)."""
    if rewards.numel() == 0:
        return rewards
    num_seqs = int(seq_ids.max()) + 1
    last = seq_ids.new_full((num_seqs,), -1).scatter_reduce(0, seq_ids, turns.long(), "amax")
    power = (last[seq_ids] - turns).double()
    return (rewards.double() * gamma**power).to(rewards.dtype)


def last_step_mask(seq_ids: Tensor, steps: Tensor) -> Tensor:
    """``[N]`` bool: the sample sits at the largest ``steps`` value of its sequence ``seq_ids``
    (all tree-sampled siblings of the last step)."""
    if steps.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    num_seqs = int(seq_ids.max()) + 1
    last = steps.new_full((num_seqs,), torch.iinfo(steps.dtype).min).scatter_reduce(0, seq_ids, steps, "amax")
    return steps == last[seq_ids]


def invalid_action_penalty(rewards: Tensor, valid: Tensor, *, penalty: float) -> Tensor:
    """``r_i + penalty`` where ``valid_i`` is False, ``r_i`` otherwise."""
    return torch.where(valid.bool(), rewards, rewards + penalty)


def rewards_to_tokens(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sample reward ``[B]`` on the last response token of its row: ``[B, T]``, 0 elsewhere
    (rows without response tokens get all zeros). Used to feed sample rewards to token-level GAE."""
    mask = response_mask.bool()
    num_cols = mask.shape[1]
    positions = torch.arange(num_cols, device=mask.device).expand_as(mask)  # [B, T]
    last = torch.where(mask, positions, -1).amax(dim=1) if num_cols else positions.new_full((len(mask),), -1)
    out = rewards.new_zeros(mask.shape)  # [B, T]
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    return out


def dynamic_sampling_mask(advantages: Tensor, gid: Tensor) -> tuple[Tensor, int]:
    """Keep mask ``[N]`` dropping every group ``gid [N]`` whose ``advantages [N]`` are all exactly 0,
    and the number of dropped groups.

    Exactly, not within a tolerance: the estimators compute group statistics in float64 from float32
    rewards, where equal rewards give a mean equal to each of them and so advantages of exactly 0."""
    if advantages.numel() == 0:
        return torch.zeros(0, dtype=torch.bool), 0
    num_groups = int(gid.max()) + 1
    nonzero = advantages.ne(0).double()
    signal = nonzero.new_zeros(num_groups).index_add_(0, gid, nonzero) > 0  # [G]
    present = gid.new_zeros(num_groups, dtype=torch.bool).index_fill_(0, gid, True)
    flat = ~signal & present
    return ~flat[gid], int(flat.sum())


@dataclass
class RewardConfig:
    alpha: float = 0.0  # weight of the agent's local reward next to the team reward
    turn_gamma: float = 1.0  # 1.0: no turn discount
    invalid_penalty: float = 0.0  # added (so <= 0) to samples whose action did not parse
    dynamic_sampling: bool = False  # drop groups whose advantages are all 0 (group key: the estimator's)

    def __post_init__(self) -> None:
        if not 0 < self.turn_gamma <= 1:
            raise ValueError(f"reward.turn_gamma must be in (0, 1], got {self.turn_gamma}")
        if self.invalid_penalty > 0:
            raise ValueError(
                f"reward.invalid_penalty is added to invalid samples and must be <= 0, "
                f"got {self.invalid_penalty}"
            )


def shape_rewards(
    team: Tensor,
    local: Tensor,
    *,
    valid: Tensor,
    seq_ids: Tensor,
    turns: Tensor,
    cfg: RewardConfig,
    team_mask: Tensor | None = None,
) -> Tensor:
    """Place, mix, turn-discount, then penalise invalid actions (see the module docstring). All
    ``[N]``; ``seq_ids`` identify (task, episode, agent) sequences, e.g. ``group_ids(index, ("task",
    "episode", "agent"))``; ``team_mask`` marks the samples that keep the team reward (None: all)."""
    if team_mask is not None:
        team = torch.where(team_mask, team, torch.zeros_like(team))
    r = mix_rewards(team, local, alpha=cfg.alpha)
    if cfg.turn_gamma != 1.0:
        r = discount_turns(r, seq_ids, turns, gamma=cfg.turn_gamma)
    return invalid_action_penalty(r, valid, penalty=cfg.invalid_penalty)
