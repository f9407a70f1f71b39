"""Advantage estimators against hand-computed numbers (default std_ddof=1, the unbiased std; eps=1e-12
where exactness matters). The numbers of the tests before issue #16 used the population std; they were
recomputed for std_ddof=1 (a group of n shrinks by sqrt((n - 1) / n))."""

import math

import pytest
import torch

from megamarl.rl.advantages import (
    AdvantageConfig,
    GroupIndex,
    anchor_ids,
    compute_advantages,
    discounted_returns,
    gae,
    group_ids,
    masked_whiten,
)

EPS = 1e-12


def adv(name, rewards, index, *, response_mask=None, **cfg):
    cfg.setdefault("eps", EPS)
    if response_mask is None and name == "reinforce_pp":  # one response token per sample
        response_mask = torch.ones(len(rewards), 1, dtype=torch.bool)
    return compute_advantages(
        torch.tensor(rewards), index, AdvantageConfig(estimator=name, **cfg), response_mask=response_mask
    )


def close(actual, expected, atol=1e-6):
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_group_ids_contiguous_lexicographic():
    index = GroupIndex(task=[1, 0, 1, 0], agent=[0, 0, 1, 1])
    assert group_ids(index, ("task", "agent")).tolist() == [2, 0, 3, 1]
    assert group_ids(index, ("agent",)).tolist() == [0, 0, 1, 1]
    assert group_ids(index, ()).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="group_by"):
        group_ids(index, ("colour",))


def test_grpo_groups_singletons_and_equal_rewards():
    index = GroupIndex(task=[0, 0, 0, 0, 1, 1, 2])
    # task 0: mean 0.5, std sqrt(1/3) (population: 0.5); task 1: all equal -> 0; task 2: singleton -> 0.
    a = 0.5 / math.sqrt(1 / 3)
    close(adv("grpo", [1.0, 0, 0, 1, 2, 2, 5], index), [a, -a, -a, a, 0, 0, 0])
    close(adv("grpo", [1.0, 0, 0, 1, 2, 2, 5], index, std_ddof=0), [1, -1, -1, 1, 0, 0, 0])
    close(adv("grpo", [1.0, 0, 0, 1, 2, 2, 5], index, norm_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0])
    # mean 2, std 1 (population: sqrt(2/3))
    close(adv("grpo", [3.0, 1, 2], GroupIndex(task=[0, 0, 0])), [1, -1, 0])
    s = math.sqrt(2 / 3)
    close(adv("grpo", [3.0, 1, 2], GroupIndex(task=[0, 0, 0]), std_ddof=0), [1 / s, -1 / s, 0])


def test_std_ddof_item10_unbiased_by_default():
    # issue #16 item 10: {1, 0} gives +-0.707 with the references' unbiased std, +-1 with the population std
    index = GroupIndex(task=[0, 0])
    close(adv("grpo", [1.0, 0.0], index), [0.70710678, -0.70710678])
    close(adv("grpo", [1.0, 0.0], index, std_ddof=1), [0.70710678, -0.70710678])
    close(adv("grpo", [1.0, 0.0], index, std_ddof=0), [1, -1])
    close(adv("at_grpo", [1.0, 0.0], index), [0.70710678, -0.70710678])
    close(adv("drmas_grpo", [1.0, 0.0], index), [0.70710678, -0.70710678])
    assert AdvantageConfig().std_ddof == 1
    # token whitening (gae): values {1, 0, 0, 0}: mean .25, unbiased std .5 -> 1.5, -0.5
    out = masked_whiten(torch.tensor([[1.0, 0, 0, 0]]), torch.ones(1, 4, dtype=torch.bool), eps=EPS)
    close(out, [[1.5, -0.5, -0.5, -0.5]])


def test_grpo_default_eps_all_equal_no_nan():
    out = compute_advantages(torch.ones(4), GroupIndex(task=[0, 0, 0, 0]), AdvantageConfig())
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_grpo_configurable_group_by():
    index = GroupIndex(task=[0, 0, 0, 0], agent=[0, 0, 1, 1])
    r = 1 / math.sqrt(2)  # groups of 2: unbiased std = |a - b| / sqrt(2)
    close(adv("grpo", [1.0, 0, 4, 2], index, group_by=["task", "agent"]), [r, -r, r, -r])
    close(adv("grpo", [1.0, 0, 4, 2], index, group_by=["task"], norm_std=False), [-0.75, -1.75, 2.25, 0.25])


def test_at_grpo_groups_tree_candidates_of_one_step():
    # agent 0 turn 0: 3 branches; agent 0 turn 1: 2 equal branches; agent 1 turn 0: singleton.
    index = GroupIndex(
        task=[0] * 6, agent=[0, 0, 0, 0, 0, 1], turn=[0, 0, 0, 1, 1, 0], branch=[0, 1, 2, 0, 1, 0]
    )
    # group {1,0,0}: mean 1/3, std sqrt(1/3) -> (2/3)*sqrt(3), (-1/3)*sqrt(3)
    r3 = math.sqrt(3)
    close(adv("at_grpo", [1.0, 0, 0, 1, 1, 1], index), [2 / 3 * r3, -r3 / 3, -r3 / 3, 0, 0, 0])


def test_drmas_agent_invoked_several_times_and_singleton():
    # task 0: agent A twice in each of 2 episodes (rewards 1,0,0,0); agent B once (0.5) -> singleton.
    # task 1: agent A twice with equal rewards -> 0.
    index = GroupIndex(
        task=[0, 0, 0, 0, 0, 1, 1],
        episode=[0, 0, 1, 1, 0, 2, 2],
        agent=[0, 0, 0, 0, 1, 0, 0],
        turn=[0, 1, 0, 1, 0, 0, 1],
    )
    # A in task 0: mean 0.25, std sqrt(0.75 / 3) = 0.5
    expected = [1.5, -0.5, -0.5, -0.5, 0.5, 0, 0]
    close(adv("drmas_grpo", [1.0, 0, 0, 0, 0.5, 1, 1], index), expected)


def test_dr_grpo_no_std_division():
    close(adv("dr_grpo", [1.0, 0, 0, 3], GroupIndex(task=[0, 0, 0, 1])), [2 / 3, -1 / 3, -1 / 3, 0])


def test_rloo_leave_one_out_and_singleton():
    index = GroupIndex(task=[0, 0, 0, 0, 1, 1, 2])
    # group 0 sum 2: 1 - 1/3, 0 - 2/3; group 1: 3 - 1, 1 - 3; singleton: 0
    close(adv("rloo", [1.0, 0, 0, 1, 3, 1, 7], index), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2, -2, 0])


def test_reinforce_pp_batch_normalised():
    index = GroupIndex(task=[0, 0, 1, 1])  # task groups are ignored: statistics over the policy's tokens
    # one token each: mean 3, std sqrt(14 / 3)
    close(adv("reinforce_pp", [1.0, 2, 3, 6], index), [x / math.sqrt(14 / 3) for x in (-2, -1, 0, 3)])


def test_reinforce_pp_whitens_over_tokens_per_policy_item5():
    # issue #16 item 5: rewards [1, 0] with 1 and 3 response tokens. Token values {1, 0, 0, 0}: mean .25,
    # unbiased std .5 -> [1.5, -0.5] (verl); per-sample whitening gave [1, -1].
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    close(adv("reinforce_pp", [1.0, 0.0], GroupIndex(task=[0, 1]), response_mask=mask), [1.5, -0.5])
    # policy 1 tokens {5, 5, 3, 3}: mean 4, std sqrt(4 / 3) -> +-sqrt(3) / 2
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    index = GroupIndex(task=[0, 1, 2, 3], policy=[0, 0, 1, 1])
    h = math.sqrt(3) / 2
    close(adv("reinforce_pp", [1.0, 0.0, 5.0, 3.0], index, response_mask=mask), [1.5, -0.5, h, -h])
    # a row without response tokens takes no part in the statistics
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    out = adv("reinforce_pp", [1.0, 0.0, 100.0], GroupIndex(task=[0, 1, 2]), response_mask=mask)
    close(out[:2], [1.5, -0.5])
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages(
            torch.tensor([1.0]), GroupIndex(task=[0]), AdvantageConfig(estimator="reinforce_pp")
        )


def test_reinforce_pp_discounted_over_turns():
    # agent 0 turns 2, 0, 1 (shuffled) with rewards 1, 0, 0; agent 1 turn 0 reward 0. gamma 0.5
    # returns: turn0 0.25, turn1 0.5, turn2 1, agent1 0 -> mean 0.4375
    index = GroupIndex(episode=[0, 0, 0, 0], agent=[0, 0, 1, 0], turn=[2, 0, 0, 1])
    out = adv("reinforce_pp", [1.0, 0, 0, 0], index, discount_turns=True, gamma=0.5, norm_std=False)
    close(out, [0.5625, -0.1875, -0.4375, 0.0625])


def test_discounted_returns_siblings_are_parallel_item2():
    # issue #16 item 2: three tree-sampled siblings at step 0 (reward 1 each), then step 1 (reward 1),
    # gamma .9: each sibling is 1 + .9 * 1 = 1.9 (chained as consecutive steps they were 3.439, 2.71, 1.9).
    out = discounted_returns(
        torch.tensor([1.0, 1, 1, 1]), torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1]), gamma=0.9
    )
    close(out, [1.9, 1.9, 1.9, 1.0])
    # siblings at the next position: their mean return continues the trajectory.
    # step 1 siblings {1, 0} -> continuation .5; step 0: 0 + .5 * .5 = .25
    out = discounted_returns(
        torch.tensor([0.0, 1, 0]), torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 1]), gamma=0.5
    )
    close(out, [0.25, 1, 0])
    # gaps in the order key do not discount; two sequences are independent
    out = discounted_returns(
        torch.tensor([0.0, 2, 4, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 5, 3, 9]), gamma=0.5
    )
    close(out, [1, 2, 4.5, 1])


def test_reinforce_pp_turn_discount_siblings_item2():
    # issue #16 item 2: rewards [0, 1, 0] on turns [0, 0, 1] (two siblings of turn 0) -> returns [0, 1, 0],
    # not [0.5, 1, 0]. Returns then whitened over one token each: mean 1/3, std sqrt(1/3).
    index = GroupIndex(turn=[0, 0, 1])
    out = adv("reinforce_pp", [0.0, 1.0, 0.0], index, discount_turns=True, gamma=0.5, norm_std=False)
    close(out, [-1 / 3, 2 / 3, -1 / 3])
    r3 = math.sqrt(3)
    out = adv("reinforce_pp", [0.0, 1.0, 0.0], index, discount_turns=True, gamma=0.5)
    close(out, [-r3 / 3, 2 * r3 / 3, -r3 / 3])


def _gigpo_index():
    # task 0: e0 = [s0 r0, s1 r1], e1 = [s0 r0, s2 r0, s1 r0]; task 1: e2 = [s0 r1]. Shuffled rows.
    rows = [  # (task, episode, step, anchor, reward)
        (0, 1, 2, "s1", 0.0),
        (0, 0, 0, "s0", 0.0),
        (1, 2, 0, "s0", 1.0),
        (0, 1, 0, "s0", 0.0),
        (0, 0, 1, "s1", 1.0),
        (0, 1, 1, "s2", 0.0),
    ]
    index = GroupIndex(
        task=[r[0] for r in rows],
        episode=[r[1] for r in rows],
        step=[r[2] for r in rows],
        anchors=[r[3] for r in rows],
    )
    return index, [r[4] for r in rows]


def test_gigpo_shared_anchor_across_episodes():
    index, rewards = _gigpo_index()
    # A_E: task 0 returns {e0: 1, e1: 0} -> +-r (r = 1/sqrt(2), unbiased std of a pair); task 1 singleton ->
    # 0.
    # step returns (gamma .5): e0 s0 .5, e0 s1 1; e1 all 0.
    # anchors: s0 {.5, 0} -> +-r; s1 {1 (e0), 0 (e1)} -> +-r; s2 singleton -> 0; task-1 s0 singleton.
    r = 1 / math.sqrt(2)
    close(adv("gigpo", rewards, index, gamma=0.5), [-2 * r, 2 * r, 0, -2 * r, 2 * r, -r])
    close(
        adv("gigpo", rewards, index, gamma=0.5, gigpo_omega=0.5),
        [-1.5 * r, 1.5 * r, 0, -1.5 * r, 1.5 * r, -r],
    )
    close(adv("gigpo", rewards, index, gamma=0.5, std_ddof=0), [-2, 2, 0, -2, 2, -1])


def test_gigpo_episode_return_counts_siblings_once():
    # e0: two tree siblings at step 0 (rewards 1, 0) then step 1 (reward 1); e1: one step, reward 1.
    # R_e0 = mean(1, 0) + 1 = 1.5 (summing the rows gave 2); R_e1 = 1. A_E = +-r; every anchor is unique.
    index = GroupIndex(episode=[0, 0, 0, 1], step=[0, 0, 1, 0], anchors=["a", "b", "c", "d"])
    r = 1 / math.sqrt(2)
    close(adv("gigpo", [1.0, 0, 1, 1], index), [r, r, r, -r])


def test_anchor_ids_exact_similarity_and_none():
    prefix = torch.zeros(6, dtype=torch.long)
    anchors = ["abcd", "abce", "xyz", "abcd", None, None]
    assert anchor_ids(prefix, anchors).tolist() == [0, 1, 2, 0, 3, 4]
    # ratio("abce", "abcd") = 2*3/8 = 0.75 >= 0.7 -> merged
    assert anchor_ids(prefix, anchors, similarity=0.7).tolist() == [0, 0, 1, 0, 2, 3]
    assert anchor_ids(torch.tensor([0, 1]), ["a", "a"]).tolist() == [0, 1]


def test_gigpo_similarity_merges_anchor_groups():
    index = GroupIndex(episode=[0, 1], anchors=["the cat sat", "the cat sat."])  # ratio 22/23
    # one task: A_E = +-r; step groups: separate singletons (exact) or one group (+-r)
    r = 1 / math.sqrt(2)
    close(adv("gigpo", [1.0, 0.0], index), [r, -r])
    close(adv("gigpo", [1.0, 0.0], index, gigpo_similarity=0.9), [2 * r, -2 * r])


def test_gae_hand_computed_and_padding_ignored():
    nan = float("nan")
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[nan, 0, 0, 1, 9], [1, 1, 1, 1, 1]])
    values = torch.tensor([[nan, 0.5, 0.6, 0.7, 1e9], [1, 2, 3, 4, 5]])
    a, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(a, [[0, 0.5, 0.4, 0.3, 0], [0] * 5])
    close(ret, [[0, 1, 1, 1, 0], [0] * 5])
    # gamma .9 lam .8: A3 = .3; A2 = .03 + .72*.3 = .246; A1 = .04 + .72*.246 = .21712
    a, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(a, [[0, 0.21712, 0.246, 0.3, 0], [0] * 5])
    close(ret, [[0, 0.71712, 0.846, 1.0, 0], [0] * 5])


def test_gae_skips_masked_gaps():
    gapped = gae(
        torch.tensor([[0.0, 5, 1]]),
        torch.tensor([[0.5, 7, 0.7]]),
        torch.tensor([[1, 0, 1]]).bool(),
        gamma=0.9,
        lam=0.8,
    )[0]
    contiguous = gae(
        torch.tensor([[0.0, 1]]), torch.tensor([[0.5, 0.7]]), torch.ones(1, 2).bool(), gamma=0.9, lam=0.8
    )[0]
    close(gapped[:, [0, 2]], contiguous.tolist())
    assert gapped[0, 1] == 0


def test_gae_estimator_places_reward_on_last_token_and_whitens():
    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.0, 0.25, 0.5, 0.0]])
    index = GroupIndex(task=[0])
    out, returns = compute_advantages(
        torch.tensor([1.0]),
        index,
        AdvantageConfig(estimator="gae", norm_std=False),
        response_mask=mask,
        values=values,
    )
    close(out, [[0, 0.75, 0.5, 0]])
    close(returns, [[0, 1, 1, 0]])  # A + V: the critic's targets
    out, _ = compute_advantages(
        torch.tensor([1.0]),
        index,
        AdvantageConfig(estimator="gae", eps=EPS),
        response_mask=mask,
        values=values,
    )
    r = 1 / math.sqrt(2)
    close(out, [[0, r, -r, 0]])  # mean .625, unbiased std .125 * sqrt(2)
    # a batch sharded in two: the all_reduce hook sums the statistics, each half whitened as the whole
    halves = [(mask[:, :2], values[:, :2]), (mask[:, 2:], values[:, 2:])]
    adv = [torch.tensor([[0.0, 0.75]]), torch.tensor([[0.5, 0.0]])]
    totals = sum(
        torch.stack(
            [
                torch.where(m, a, 0.0).double().sum(),
                torch.where(m, a, 0.0).double().pow(2).sum(),
                m.sum().double(),
            ]
        )
        for (m, _), a in zip(halves, adv)
    )
    for (m, _), a, expected in zip(halves, adv, ([[0, 1]], [[-1, 0]])):  # population std: mean .625, std .125
        close(masked_whiten(a, m, eps=EPS, ddof=0, all_reduce=lambda t: t.copy_(totals)), expected)
    with pytest.raises(ValueError, match="gae"):
        compute_advantages(torch.tensor([1.0]), index, AdvantageConfig(estimator="gae"))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"estimator": "ppo2"}, "advantage.estimator"),
        ({"group_by": ["colour"]}, "advantage.group_by"),
        ({"eps": 0.0}, "advantage.eps"),
        ({"gamma": 1.5}, "advantage.gamma"),
        ({"lam": -0.1}, "advantage.lam"),
        ({"std_ddof": 2}, "advantage.std_ddof"),
        ({"gigpo_omega": -1.0}, "advantage.gigpo_omega"),
        ({"gigpo_similarity": 0.0}, "advantage.gigpo_similarity"),
    ],
)
def test_config_validation_names_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        AdvantageConfig(**kwargs)
