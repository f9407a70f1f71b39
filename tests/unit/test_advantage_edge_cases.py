"""Estimator edge cases of issue #27 item 2, each with hand numbers: dynamic sampling filters on the
advantages the estimator computes (GiGPO's last-step team reward, Dr.MAS singletons), an episode
that lost its last step is dropped and counted, estimator_kwargs cannot duplicate algorithm keys,
the value loss has its own aggregation key, and exhausted refills either train or stop."""

import math
from pathlib import Path

import pytest
import torch

from megamarl.cli.configure import load_config
from megamarl.config import AlgorithmConfig
from megamarl.errors import RefillExhaustedError, RolloutFailureError
from megamarl.rl.advantages import advantage_config, check_algorithm
from megamarl.rl.batch import collate, concat
from megamarl.rl.losses import LOSS_AGGREGATIONS, value_loss
from megamarl.rl.prepare import complete_episodes, prepare_batch, prepare_rollout
from megamarl.rl.sample import Sample, mark_episode_ends

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "signalling_tiny.yaml"
R = 1 / math.sqrt(2)  # a {1, 0} pair normalised with the unbiased std


def _sample(task, episode, *, step=0, agent="solver", team=0.0, local=0.0, anchor=None):
    return Sample(
        task_id=task,
        episode_id=f"{task}/{episode}",
        agent=agent,
        policy="p",
        turn=step,
        step=step,
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        team_reward=team,
        local_reward=local,
        anchor=anchor,
    )


def _episodes(task, outcomes, *, anchor_first=None):
    """Samples of ``task``: one episode per (num_steps, team reward), the team reward copied onto
    every call as the rollout records it; ``anchor_first`` names the shared start observation."""
    return [
        _sample(task, e, step=s, team=team, anchor=anchor_first if s == 0 else None)
        for e, (num_steps, team) in enumerate(outcomes)
        for s in range(num_steps)
    ]


def _no_refill(round_):
    raise AssertionError("no refill expected")


def close(actual, expected):
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )


GIGPO = {"estimator": "gigpo", "dynamic_sampling": True, "estimator_kwargs": {"eps": 1e-12}}


# ---- (a) GiGPO + dynamic sampling ------------------------------------------------------------------


def test_gigpo_task_whose_episodes_all_succeed_is_dropped_and_refilled():
    # task a: two 2-step wins. The team reward sits on the last step: per-step rewards {0, 1, 0, 1}
    # (not flat, the old filter kept it), but both returns are 1 and every anchor group is a singleton:
    # all advantages 0. Task b: a win and a fail -> A_E = +-R on both steps. num_tasks=2 and one
    # refill round: a is not informative, so round 1 is drawn (task c, a fail and a win).
    batch = collate(_episodes("a", [(2, 1.0), (2, 1.0)]) + _episodes("b", [(2, 1.0), (2, 0.0)]), pad_id=0)
    refill = collate(_episodes("c", [(2, 0.0), (2, 1.0)]), pad_id=0)
    calls = []

    def draw(round_):
        calls.append(round_)
        return refill

    algo = AlgorithmConfig(**GIGPO, max_refill_rounds=1)
    out, metrics = prepare_batch(batch, algo, num_tasks=2, draw=draw)
    assert calls == [1]
    assert metrics == {
        "rollout/dropped_groups": 1.0,
        "rollout/refill_rounds": 1.0,
        "rollout/informative_tasks": 2.0,
        "rollout/refill_exhausted": 0.0,
    }
    assert out.names("task") == ["b"] * 4 + ["c"] * 4
    close(out.advantages, [R, R, -R, -R, -R, -R, R, R])


def test_gigpo_all_wins_of_different_lengths_keep_their_step_signal():
    # Both episodes win (A_E = 0) but from the shared start state the 2-step win has the larger
    # discounted return (gamma .5: G = .5 vs .25): A_S = +-R there. The estimator compares it: kept.
    batch = collate(_episodes("a", [(2, 1.0), (3, 1.0)], anchor_first="start"), pad_id=0)
    algo = AlgorithmConfig(
        estimator="gigpo", dynamic_sampling=True, estimator_kwargs={"eps": 1e-12, "gamma": 0.5}
    )
    out, metrics = prepare_batch(batch, algo, num_tasks=1, draw=_no_refill)
    assert metrics["rollout/dropped_groups"] == 0 and out.num_samples == 5
    close(out.advantages, [R, 0, -R, 0, 0])


# ---- (b) Dr.MAS singletons -------------------------------------------------------------------------


def test_drmas_singleton_kept_when_its_advantage_is_its_reward():
    # Rule: a group is dropped exactly when every advantage the estimator gives it is 0.
    # task t: solver {1, 0} (+-R); verifier acted once (singleton, advantage = raw reward 0.5): kept,
    #   where the old reward filter dropped it as zero-variance although it trained with 0.5.
    # task u: solver {1, 1} (flat, 0); verifier once with reward 0 (advantage 0): both dropped.
    samples = [
        _sample("t", 0, local=1.0),
        _sample("t", 1, local=0.0),
        _sample("t", 0, agent="verifier", local=0.5),
        _sample("u", 0, local=1.0),
        _sample("u", 1, local=1.0),
        _sample("u", 0, agent="verifier", local=0.0),
    ]
    algo = AlgorithmConfig(estimator="drmas_grpo", dynamic_sampling=True, estimator_kwargs={"eps": 1e-12})
    out, metrics = prepare_batch(collate(samples, pad_id=0), algo, num_tasks=1, draw=_no_refill)
    assert metrics["rollout/dropped_groups"] == 2 and metrics["rollout/informative_tasks"] == 1
    assert out.names("task") == ["t"] * 3 and out.names("agent") == ["solver", "solver", "verifier"]
    close(out.advantages, [R, -R, 0.5])


# ---- (c) an episode that lost its last step --------------------------------------------------------


def test_episode_without_its_last_step_is_dropped_and_counted():
    # e0 wins, e1 fails, e2 wins, all in 2 steps; e2's last-step sample is removed before preparation
    # (a stale policy share). Kept, GiGPO would move e2's team reward onto its step 0 (return 1).
    # Dropped: returns {1, 0} -> A_E = +-R.
    samples = _episodes("t", [(2, 1.0), (2, 0.0), (2, 1.0)])
    mark_episode_ends(samples)
    assert [s.episode_last_step for s in samples] == [1] * 6
    kept = samples[:-1]
    algo = AlgorithmConfig(estimator="gigpo", estimator_kwargs={"eps": 1e-12})
    batch, metrics = prepare_rollout(kept, [], algo, pad_id=0, num_tasks=1, draw=_no_refill)
    assert metrics["rollout/dropped_incomplete_episodes"] == 1.0
    assert batch.names("episode") == ["t/0", "t/0", "t/1", "t/1"]
    close(batch.advantages, [R, R, -R, -R])
    # an episode that simply ended earlier is complete; samples without the stamp count as complete
    short = _episodes("t", [(1, 1.0)])
    mark_episode_ends(short)
    assert complete_episodes(short) == (short, 0)
    assert complete_episodes(_episodes("t", [(2, 1.0)])[:1])[1] == 0
    # nothing left to train on: a rollout failure naming the cause
    with pytest.raises(RolloutFailureError, match="last-step"):
        prepare_rollout(samples[4:5], [], algo, pad_id=0, num_tasks=1, draw=_no_refill)
    # estimators that keep the team reward on every call do not need the last step: nothing dropped
    batch, metrics = prepare_rollout(
        kept, [], AlgorithmConfig(estimator="grpo"), pad_id=0, num_tasks=1, draw=_no_refill
    )
    assert batch.num_samples == 5 and "rollout/dropped_incomplete_episodes" not in metrics


# ---- (d) config: estimator_kwargs, value loss aggregation, exhausted refill ------------------------


@pytest.mark.parametrize(
    "key, own", [("std_ddof", "std_ddof"), ("group_by", "group_by"), ("norm_std", "normalize_std")]
)
def test_estimator_kwargs_duplicating_an_algorithm_key_is_rejected(key, own):
    with pytest.raises(ValueError, match=rf"algorithm.estimator_kwargs.{key} duplicates algorithm.{own}"):
        AlgorithmConfig(estimator_kwargs={key: 0})
    with pytest.raises(ValueError, match=f"algorithm.estimator_kwargs.{key}"):
        load_config(CONFIG, [f"+algorithm.estimator_kwargs.{key}=0"])


def test_estimator_kwargs_checked_at_load():
    with pytest.raises(ValueError, match="algorithm.estimator_kwargs.*gama"):
        load_config(CONFIG, ["+algorithm.estimator_kwargs.gama=0.9"])
    with pytest.raises(ValueError, match="algorithm.estimator_kwargs.*advantage.gamma"):
        load_config(CONFIG, ["+algorithm.estimator_kwargs.gamma=2.0"])
    with pytest.raises(ValueError, match="algorithm.dynamic_sampling.*gae"):
        load_config(CONFIG, ["algorithm.estimator=gae", "algorithm.dynamic_sampling=true"])
    cfg = load_config(CONFIG, ["algorithm.std_ddof=0", "+algorithm.estimator_kwargs.gamma=0.9"])
    adv = advantage_config(cfg.algorithm)
    assert (adv.std_ddof, adv.gamma, adv.group_by) == (0, 0.9, ["task", "agent", "turn"])


def test_value_loss_has_its_own_aggregation_key():
    algo = AlgorithmConfig(loss_agg="seq-mean-token-sum")
    assert algo.value_loss_agg == "token-mean"  # not the policy loss's
    with pytest.raises(ValueError, match="algorithm.value_loss_agg"):
        check_algorithm(AlgorithmConfig(value_loss_agg="token-sum"))  # load time (megamarl.cli.configure)
    # values [[1, 2, -], [3, -, -]], returns 0, unclipped: per token .5 v^2 = [[.5, 2], [4.5]]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[1.0, 2, 9], [3, 9, 9]])
    per_token, _ = value_loss(values, torch.zeros_like(values), torch.zeros_like(values), mask, clip=None)
    agg = {
        name: float(LOSS_AGGREGATIONS.get(name)(per_token, mask))
        for name in ("token-mean", "seq-mean-token-sum")
    }
    assert agg == pytest.approx({"token-mean": 7 / 3, "seq-mean-token-sum": 3.5})


def _grpo_task(task, rewards):
    return collate([_sample(task, g, local=r) for g, r in enumerate(rewards)], pad_id=0)


def test_refill_exhausted_train_or_stop():
    # a informative, b flat; num_tasks=2; every refill round is flat -> exhausted after 2 rounds
    batch = concat([_grpo_task("a", [1, 0]), _grpo_task("b", [1, 1])])

    def flat(round_):
        return _grpo_task(f"flat{round_}", [0, 0])

    algo = AlgorithmConfig(
        estimator="grpo",
        group_by=["task"],
        dynamic_sampling=True,
        max_refill_rounds=2,
        estimator_kwargs={"eps": 1e-12},
    )
    out, metrics = prepare_batch(batch, algo, num_tasks=2, draw=flat)
    assert metrics["rollout/refill_exhausted"] == 1.0 and metrics["rollout/refill_rounds"] == 2.0
    assert out.names("task") == ["a", "a"]
    close(out.advantages, [R, -R])
    stop = AlgorithmConfig(
        estimator="grpo",
        group_by=["task"],
        dynamic_sampling=True,
        max_refill_rounds=2,
        refill_exhausted="stop",
    )
    with pytest.raises(RefillExhaustedError, match="algorithm.refill_exhausted=stop") as info:
        prepare_batch(batch, stop, num_tasks=2, draw=flat)
    assert isinstance(info.value, RolloutFailureError)  # scripts/train.py: "training stopped", exit code 5
    with pytest.raises(ValueError, match="algorithm.refill_exhausted"):
        AlgorithmConfig(refill_exhausted="skip")
    with pytest.raises(ValueError, match="algorithm.max_refill_rounds > 0"):
        AlgorithmConfig(dynamic_sampling=True, refill_exhausted="stop")
