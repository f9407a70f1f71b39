"""rollout.opponent_pool: which slot a snapshot goes to, which slot an episode faces, the mapping over
rollout.policy_mapping, and the config's checks (the run itself: tests/integration/test_rl_controls.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megamarl.cli.configure import load_config
from megamarl.driver.opponent_pool import (
    OpponentPool,
    OpponentPoolConfig,
    pick_latest,
    pick_uniform,
    snapshot_slot,
)
from megamarl.orchestration.envs.games import tictactoe_vs_pool

ROOT = Path(__file__).resolve().parents[2]
POOL = ROOT / "configs" / "tictactoe_pool.yaml"


def test_snapshots_go_round_robin_every_n_steps():
    assert [snapshot_slot(step, every=2, num_slots=3) for step in range(9)] == [
        None,
        None,
        0,
        None,
        1,
        None,
        2,
        None,
        0,
    ]
    assert [snapshot_slot(step, every=1, num_slots=2) for step in range(1, 5)] == [0, 1, 0, 1]


def test_picks():
    assert pick_latest([0, 0, 0], random.Random(0)) == 0  # all initial: the first slot
    assert pick_latest([4, 6, 2], random.Random(0)) == 1
    picks = [pick_uniform([4, 6, 2], random.Random(seed)) for seed in range(300)]
    assert {picks.count(i) for i in range(3)} <= set(range(80, 121))  # ~100 each
    assert pick_uniform([4, 6, 2], random.Random(7)) == pick_uniform([4, 6, 2], random.Random(7))


def test_the_mapping_resolves_the_alias_per_episode():
    pool = OpponentPool(OpponentPoolConfig(learner="alpha", snapshots=["past_1", "past_2"], pick="latest"))
    mapping = pool.mapping(tictactoe_vs_pool)
    assert [mapping(seat, 0) for seat in ("player_1", "player_2")] == ["alpha", "past_1"]
    assert [mapping(seat, 1) for seat in ("player_1", "player_2")] == ["past_1", "alpha"]
    pool.record(1, 4)  # past_2 now holds alpha after step 4
    assert mapping("player_2", 0) == "past_2" and pool.metrics() == {
        "opponent_pool/num_snapshots": 1.0,
        "opponent_pool/past_1/snapshot_step": 0.0,
        "opponent_pool/past_2/snapshot_step": 4.0,
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.opponent_pool.pick=best"], "unknown opponent pick rollout.opponent_pool.pick='best'"),
        (["rollout.opponent_pool.every=0"], "rollout.opponent_pool.every must be >= 1"),
        (
            ["rollout.opponent_pool.learner=past_1"],
            "rollout.opponent_pool.learner='past_1' must be a trained policy",
        ),
        (
            ["policies.past_2.frozen=false"],
            "rollout.opponent_pool.snapshots: 'past_2' must be a frozen policy",
        ),
        (
            ["policies.past_2.model=tiny-plain-llama"],
            "rollout.opponent_pool.snapshots: 'past_2' must be a frozen policy",
        ),
        (["rollout.opponent_pool.alias=alpha"], "rollout.opponent_pool.alias='alpha' is a policy's name"),
        (["rollout.policy_mapping=''"], "rollout.opponent_pool needs rollout.policy_mapping"),
        (
            ["rollout.opponent_pool.snapshots=[]"],
            "rollout.opponent_pool.learner='alpha' needs rollout.opponent_pool.snapshots",
        ),
        (
            ["rollout.opponent_pool.alias=rival"],
            "rollout.policy_mapping('player_1', 1) returned 'opponent', not a policy",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    pytest.importorskip("pygame")  # the config's env factory
    with pytest.raises(ValueError) as info:
        load_config(POOL, overrides)
    assert message in str(info.value)


def test_the_pool_config_loads():
    pytest.importorskip("pygame")
    pool = load_config(POOL).rollout.opponent_pool
    assert (pool.learner, pool.snapshots, pool.every, pool.pick, pool.enabled) == (
        "alpha",
        ["past_1", "past_2"],
        2,
        "uniform",
        True,
    )
