"""Reward shaping and dynamic sampling against hand-computed numbers."""

import pytest
import torch

from megamarl.rl.rewards import (
    RewardConfig,
    discount_turns,
    dynamic_sampling_mask,
    invalid_action_penalty,
    mix_rewards,
    rewards_to_tokens,
    shape_rewards,
    team_alpha_at,
)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=0)


def test_mix_team_and_local():
    close(mix_rewards(torch.tensor([1.0, 1, 0]), torch.tensor([1.0, 0, 1]), alpha=0.5), [1.5, 1, 0.5])


def test_discount_turns_from_last_turn_of_each_sequence():
    # seq 0: turns 0,1,2 -> gamma^2, gamma^1, gamma^0; seq 1: turns 3 and 0 (gap) -> 1 and gamma^3
    seq = torch.tensor([0, 0, 0, 1, 1])
    turns = torch.tensor([0, 1, 2, 3, 0])
    out = discount_turns(torch.tensor([1.0, 1, 1, 2, 2]), seq, turns, gamma=0.5)
    close(out, [0.25, 0.5, 1, 2, 0.25])


def test_invalid_action_penalty():
    valid = torch.tensor([True, False, False])
    out = invalid_action_penalty(torch.tensor([1.0, 0, 0.5]), valid, penalty=-1.0)
    close(out, [1, -1, -0.5])


def test_shape_rewards_order_mix_discount_penalty():
    cfg = RewardConfig(alpha=0.5, turn_gamma=0.5, invalid_penalty=-0.1)
    out = shape_rewards(
        torch.tensor([1.0, 1]),
        torch.tensor([0.0, 1]),
        valid=torch.tensor([False, True]),
        seq_ids=torch.tensor([0, 0]),
        turns=torch.tensor([0, 1]),
        cfg=cfg,
    )
    # mix [1, 1.5] -> discount [0.5, 1.5] -> penalty (not discounted) [0.4, 1.5]
    close(out, [0.4, 1.5])


def test_rewards_to_tokens_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    out = rewards_to_tokens(torch.tensor([2.0, 3, 4]), mask)
    close(out, [[0, 0, 2, 0], [0, 0, 0, 0], [4, 0, 0, 0]])


def test_dynamic_sampling_drops_groups_whose_advantages_are_all_zero():
    # group 0: a +-1 pair; group 1: a flat pair (0, 0); group 2: a Dr.MAS singleton with A = r = 0.5
    # (kept: it carries signal); group 3: a singleton with A = 0 (dropped); group 4: (0, 0, 0.25)
    advantages = torch.tensor([1.0, -1, 0, 0, 0.5, 0, 0, 0, 0.25])
    gid = torch.tensor([0, 0, 1, 1, 2, 3, 4, 4, 4])
    keep, dropped = dynamic_sampling_mask(advantages, gid)
    assert keep.tolist() == [True, True, False, False, True, False, True, True, True]
    assert dropped == 2
    gid = torch.tensor([0, 0, 2, 2])  # group id 1 absent: not counted
    keep, dropped = dynamic_sampling_mask(torch.tensor([0.0, 0, -0.5, 0.5]), gid)
    assert keep.tolist() == [False, False, True, True] and dropped == 1


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"turn_gamma": 0.0}, "reward.turn_gamma"),
        ({"invalid_penalty": 0.5}, "reward.invalid_penalty"),
    ],
)
def test_config_validation_names_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        RewardConfig(**kwargs)


def test_team_alpha_schedule_hand_numbers():
    """alpha(k) = start + (end - start) * shape(min(k / K, 1)); start 1, end 0, K 4."""

    def alphas(kind):
        return [team_alpha_at(k, start=1.0, end=0.0, num_steps=4, kind=kind) for k in range(6)]

    assert alphas("constant") == [1.0] * 6
    assert alphas("linear") == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    # cosine: 1 - (1 - cos(pi k / 4)) / 2: 1, (1 + 0.70710678) / 2, 0.5, (1 - 0.70710678) / 2, 0
    assert alphas("cosine") == pytest.approx([1.0, 0.8535533906, 0.5, 0.1464466094, 0.0, 0.0], abs=1e-10)
    assert team_alpha_at(7, start=0.2, end=0.6, num_steps=0, kind="linear") == 0.6  # no anneal steps: the end
