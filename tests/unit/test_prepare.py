"""Driver-side batch preparation (megamarl.rl.prepare): GiGPO's team reward placed once, dynamic
sampling by the estimator's own group key, DAPO refill bounded by algorithm.max_refill_rounds."""

import math

import pytest
import torch

from megamarl.config import AlgorithmConfig
from megamarl.rl.advantages import AdvantageConfig, compute_advantages, estimator_traits
from megamarl.rl.batch import collate
from megamarl.rl.prepare import (
    dynamic_sampling_key,
    fill_informative,
    prepare_batch,
    prepare_rollout,
    shaped_rewards,
)
from megamarl.rl.rewards import algorithm_at_step, check_team_alpha_schedule, last_step_mask
from megamarl.rl.sample import Sample


def _sample(task, episode, *, step=0, turn=None, agent="solver", team=0.0, local=0.0, anchor=None, branch=0):
    return Sample(
        task_id=task,
        episode_id=episode,
        agent=agent,
        policy="p",
        turn=step if turn is None else turn,
        step=step,
        branch=branch,
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        team_reward=team,
        local_reward=local,
        anchor=anchor,
    )


def _no_refill(round_):
    raise AssertionError("no refill expected")


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def _win_win_fail():
    """One task, one shared start state: a 2-step win, a 4-step win, a 3-step fail. The team reward
    is copied onto every agent call, as the rollout records it."""
    samples = []
    for episode, (length, team) in enumerate([(2, 1.0), (4, 1.0), (3, 0.0)]):
        for step in range(length):
            anchor = "start" if step == 0 else f"e{episode}s{step}"
            samples.append(_sample("t", f"t/{episode}", step=step, team=team, anchor=anchor))
    return collate(samples, pad_id=0)


def test_gigpo_counts_the_team_reward_once_item1():
    # issue #16 item 1, gamma .9, population std (the numbers). Advantages at the shared start step:
    #   reward on every call:  R = [2, 4, 0], G = [1.9, 3.439, 0]   -> [0.086, 2.404, -2.49] (long win best)
    #   reward once, last step: R = [1, 1, 0], G = [.9, .729, 0]    -> [1.622, 1.184, -2.806]
    batch = _win_win_fail()
    first = torch.tensor([0, 2, 6])  # rows of step 0
    algo = AlgorithmConfig(estimator="gigpo", std_ddof=0, estimator_kwargs={"gamma": 0.9, "eps": 1e-12})
    copied = compute_advantages(
        batch.team_rewards,
        batch.group_index(),
        AdvantageConfig(estimator="gigpo", gamma=0.9, eps=1e-12, std_ddof=0),
    )
    close(copied[first], [0.086, 2.404, -2.490], atol=1e-3)
    assert estimator_traits("gigpo").team_reward_once
    out, _ = prepare_batch(batch, algo, num_tasks=1, draw=_no_refill)
    close(out.rewards, [0, 1, 0, 0, 0, 1, 0, 0, 0])  # the team reward sits on each episode's last step
    # exact: A_E = (1/3, 1/3, -2/3) / sqrt(2/9); A_S = (G - .543) / std(.9, .729, 0)
    g = torch.tensor([0.9, 0.729, 0.0], dtype=torch.float64)
    a_s = (g - g.mean()) / g.std(unbiased=False)
    a_e = torch.tensor([1 / 3, 1 / 3, -2 / 3], dtype=torch.float64) / math.sqrt(2 / 9)
    close(out.advantages[first], (a_e + a_s).tolist())
    close(out.advantages[first], [1.622, 1.184, -2.806], atol=1e-3)
    # the default unbiased std scales both terms by sqrt(2/3)
    algo = AlgorithmConfig(estimator="gigpo", estimator_kwargs={"gamma": 0.9, "eps": 1e-12})
    out, _ = prepare_batch(batch, algo, num_tasks=1, draw=_no_refill)
    close(out.advantages[first], (math.sqrt(2 / 3) * (a_e + a_s)).tolist())
    # estimators without the trait keep the team reward on every call
    out, _ = prepare_batch(batch, AlgorithmConfig(estimator="at_grpo"), num_tasks=1, draw=_no_refill)
    close(out.rewards, [1, 1, 1, 1, 1, 1, 0, 0, 0])


def test_last_step_mask_keeps_every_sibling_of_the_last_step():
    seq = torch.tensor([0, 0, 0, 1, 1])
    steps = torch.tensor([0, 1, 1, 4, 2])
    assert last_step_mask(seq, steps).tolist() == [False, True, True, True, False]


def _drmas_batch(task="t", rewards_by_turn=((1.0, 1.0), (0.0, 0.0))):
    """One agent in two episodes of a task, two turns each; every (task, agent, turn) group is flat."""
    samples = []
    for turn, rewards in enumerate(rewards_by_turn):
        for episode, reward in enumerate(rewards):
            samples.append(_sample(task, f"{task}/{episode}", step=turn, local=reward))
    return collate(samples, pad_id=0)


def test_dynamic_sampling_uses_the_estimators_group_key_item3():
    # issue #16 item 3: with drmas_grpo the (task, agent) group {1, 1, 0, 0} is informative although
    # each (task, agent, turn) group of algorithm.group_by is flat; the rows were dropped before.
    batch = _drmas_batch()
    algo = AlgorithmConfig(
        estimator="drmas_grpo",
        team_alpha=1.0,
        dynamic_sampling=True,
        std_ddof=0,
        estimator_kwargs={"eps": 1e-12},
    )
    assert dynamic_sampling_key(algo) == ("task", "agent") and tuple(algo.group_by) == (
        "task",
        "agent",
        "turn",
    )
    out, metrics = prepare_batch(batch, algo, num_tasks=1, draw=_no_refill)
    assert out.num_samples == 4 and metrics["rollout/dropped_groups"] == 0
    close(out.advantages, [1, 1, -1, -1])  # the Dr.MAS advantages +-1 the filter used to drop
    # keyed estimators still use algorithm.group_by; at_grpo its own (task, agent, turn)
    assert dynamic_sampling_key(AlgorithmConfig(estimator="grpo", group_by=["task"])) == ("task",)
    assert dynamic_sampling_key(AlgorithmConfig(estimator="at_grpo", group_by=["task"])) == (
        "task",
        "agent",
        "turn",
    )
    out, metrics = prepare_batch(
        batch, AlgorithmConfig(estimator="at_grpo", dynamic_sampling=True), num_tasks=1, draw=_no_refill
    )
    assert metrics["rollout/dropped_groups"] == 2 and out.num_samples == 4  # nothing informative: kept whole
    assert out.advantages.abs().sum() == 0


def _grpo_task(task, rewards):
    return collate([_sample(task, f"{task}/{g}", local=r) for g, r in enumerate(rewards)], pad_id=0)


def test_refill_until_num_tasks_informative_item3():
    # DAPO refill: the batch has one informative task of the 2 wanted. Round 1 draws a flat task, round 2
    # two informative ones: 2 extra rounds, the batch keeps the first 2 informative tasks (a, c).
    from megamarl.rl.batch import concat

    algo = AlgorithmConfig(
        estimator="grpo",
        group_by=["task"],
        dynamic_sampling=True,
        max_refill_rounds=3,
        estimator_kwargs={"eps": 1e-12},
    )
    batch = concat([_grpo_task("a", [1, 0]), _grpo_task("b", [1, 1])])
    draws = {1: _grpo_task("r1", [0, 0]), 2: concat([_grpo_task("c", [0, 1]), _grpo_task("d", [1, 0])])}
    calls = []

    def draw(round_):
        calls.append(round_)
        return draws.get(round_)

    out, metrics = prepare_batch(batch, algo, num_tasks=2, draw=draw)
    assert calls == [1, 2]
    assert metrics == {
        "rollout/dropped_groups": 2.0,
        "rollout/refill_rounds": 2.0,
        "rollout/informative_tasks": 2.0,
        "rollout/refill_exhausted": 0.0,
    }
    assert sorted(set(out.names("task"))) == ["a", "c"]
    r = 1 / math.sqrt(2)
    close(out.advantages, [r, -r, -r, r])
    # bounded: every draw is flat -> max_refill_rounds rounds, then train on what there is
    calls.clear()
    out, metrics = prepare_batch(
        batch,
        algo,
        num_tasks=2,
        draw=lambda round_: calls.append(round_) or _grpo_task(f"flat{round_}", [1, 1]),
    )
    assert calls == [1, 2, 3] and metrics["rollout/refill_rounds"] == 3.0
    assert metrics["rollout/informative_tasks"] == 1.0 and set(out.names("task")) == {"a"}
    # enough informative tasks already: no draw; max_refill_rounds=0: no draw either
    out, metrics = fill_informative(
        batch.replace(rewards=shaped_rewards(batch, algo)), _no_refill, algo, num_tasks=1
    )
    assert metrics["rollout/refill_rounds"] == 0.0 and set(out.names("task")) == {"a"}
    algo0 = AlgorithmConfig(estimator="grpo", group_by=["task"], dynamic_sampling=True)
    out, metrics = prepare_batch(batch, algo0, num_tasks=2, draw=_no_refill)
    assert metrics["rollout/refill_rounds"] == 0.0


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"std_ddof": 2}, "algorithm.std_ddof"),
        ({"max_refill_rounds": -1}, "algorithm.max_refill_rounds"),
        ({"max_refill_rounds": 2}, "algorithm.max_refill_rounds"),  # needs dynamic_sampling
    ],
)
def test_algorithm_config_validation(kwargs, key):
    with pytest.raises(ValueError, match=key):
        AlgorithmConfig(**kwargs)


def test_team_alpha_schedule_shapes_the_step_rewards():
    """algorithm.team_alpha_schedule: step k's rewards use alpha(k); the default is team_alpha, unchanged."""
    batch = collate(
        [_sample("t", "t/0", team=1.0, local=2.0), _sample("t", "t/1", team=1.0, local=0.0)], pad_id=0
    )
    algo = AlgorithmConfig(team_alpha=0.5, team_alpha_schedule={"kind": "linear", "end": 1.5})
    assert [algorithm_at_step(algo, k, total_steps=4).team_alpha for k in range(5)] == [
        0.5,
        0.75,
        1.0,
        1.25,
        1.5,
    ]
    close(
        shaped_rewards(batch, algorithm_at_step(algo, 2, total_steps=4)), [3.0, 1.0]
    )  # 1 + 1.0 * 2, 1 + 1.0 * 0
    close(shaped_rewards(batch, algorithm_at_step(algo, 0, total_steps=4)), [2.0, 1.0])
    default = AlgorithmConfig(team_alpha=0.5)
    assert algorithm_at_step(default, 3, total_steps=4) is default  # kind constant: the very same settings
    with pytest.raises(ValueError, match="algorithm.team_alpha_schedule.kind='cosin'"):
        check_team_alpha_schedule(AlgorithmConfig(team_alpha_schedule={"kind": "cosin"}).team_alpha_schedule)


def test_per_policy_algorithms_compute_each_policys_advantages_over_its_own_rows():
    """policies.<p>.algorithm: policy a on GRPO (group: task, no std), policy b on GAE. One task, four
    episodes: a's team rewards 1, 0 -> advantages r - mean(a's rows) = +0.5, -0.5 (one estimator over
    the whole batch would give 1 - 0.75, 0 - 0.75); b's rows get placeholder zeros (its worker's critic
    sets them) and b's agent logs no advantage statistics."""
    rewards = {"a": (1.0, 0.0), "b": (1.0, 1.0)}
    samples = [
        Sample(
            task_id="t",
            episode_id=f"t/{p}{i}",
            agent=f"agent_{p}",
            policy=p,
            turn=0,
            prompt_ids=[1, 2],
            response_ids=[3, 4],
            rollout_logprobs=[0.0, 0.0],
            team_reward=r,
        )
        for p in ("a", "b")
        for i, r in enumerate(rewards[p])
    ]
    algo = AlgorithmConfig(estimator="grpo", group_by=["task"], normalize_std=False)
    gae = AlgorithmConfig(estimator="gae", group_by=["task"], normalize_std=False)
    whole, _ = prepare_rollout(samples, [], algo, pad_id=0, num_tasks=1, draw=_no_refill)
    close(whole.advantages, [0.25, -0.75, 0.25, 0.25])
    batch, metrics = prepare_rollout(
        samples, [], algo, pad_id=0, num_tasks=1, draw=_no_refill, policy_algos={"a": algo, "b": gae}
    )
    close(batch.advantages, [0.5, -0.5, 0.0, 0.0])
    close(batch.rewards, [1.0, 0.0, 1.0, 1.0])
    assert metrics["agent/agent_a/advantage_mean"] == 0.0 and "agent/agent_b/advantage_mean" not in metrics
    only_gae, _ = prepare_rollout(
        samples[2:], [], algo, pad_id=0, num_tasks=1, draw=_no_refill, policy_algos={"a": algo, "b": gae}
    )
    assert only_gae.advantages is None  # every policy present uses its critic
