"""The driver's plan of every policy's update (megamarl.rl.dispatch) on a hand-built batch: which rows
each DP rank trains, in which mini-batch, with which global counts, and what each rank receives."""

from __future__ import annotations

import pytest

from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.rl.batch import collate
from megamarl.rl.dispatch import BatchSplit, plan_policy, rank_batches
from megamarl.rl.sample import Sample

# (agent, policy, response tokens); every prompt is one token, so a row's length is response + 1
ROWS = [
    ("x", "alpha", 3),
    ("z", "beta", 1),
    ("y", "alpha", 1),
    ("x", "alpha", 2),
    ("y", "alpha", 0),
    ("w", "alpha", 5),
    ("z", "beta", 2),
    ("g", "gamma", 1),
]


@pytest.fixture
def batch():
    return collate(
        [
            Sample(
                "t",
                f"e{i}",
                agent,
                policy,
                0,
                prompt_ids=[5],
                response_ids=[7] * n,
                rollout_logprobs=[-0.5] * n,
            )
            for i, (agent, policy, n) in enumerate(ROWS)
        ],
        pad_id=0,
    )


def _episodes(share) -> list[list[str]]:
    return [mini.rows.names("episode") for mini in share.minis]


def test_trainable_rows_mini_batches_counts_and_dp_parts(batch):
    alpha = batch.split_by_policy()["alpha"]  # e0 x(4 tokens) e2 y(2) e3 x(3) e4 y(1, no response) e5 w(6)
    shares = plan_policy(alpha, BatchSplit(mini_batch_size=2, frozen_agents=frozenset({"w"})), num_dp=2)
    # frozen w dropped; mini-batches [e0 e2] [e3 e4]; by tokens the longer row of each goes to DP rank 0
    assert [_episodes(s) for s in shares] == [[["e0"], ["e3"]], [["e2"], ["e4"]]]
    # counts of the whole mini-batch on both ranks; e4 has no response token: not a sequence
    assert [[m.counts for m in s.minis] for s in shares] == [
        [{"num_tokens": 4, "num_seqs": 2}, {"num_tokens": 2, "num_seqs": 1}]
    ] * 2


def test_per_agent_mini_batches_and_a_zero_weight_stand_in(batch):
    alpha = batch.split_by_policy()["alpha"]
    split = BatchSplit(agent_mini_batch_sizes={"x": 1}, frozen_agents=frozenset({"w"}))
    shares = plan_policy(alpha, split, num_dp=2)
    # mini-batch k holds chunk k of every agent: x in ones [e0] [e3], y whole [e2 e4]
    assert [_episodes(s) for s in shares] == [[["e0"], ["e3"]], [["e2", "e4"], ["e3"]]]
    stand_in = shares[1].minis[1].rows  # rank 1 has no row of mini-batch [e3]: e3 with no loss
    assert not stand_in.response_mask.any() and shares[0].minis[1].rows.response_mask.any()
    assert [m.counts["num_tokens"] for m in shares[1].minis] == [4, 2]


def test_whole_batch_without_sizes_and_nothing_when_all_frozen(batch):
    beta = batch.split_by_policy()["beta"]
    (share,) = plan_policy(beta, BatchSplit(), num_dp=1)
    assert _episodes(share) == [["e1", "e6"]]
    assert [s.minis for s in plan_policy(beta, BatchSplit(frozen_agents=frozenset({"z"})), num_dp=2)] == [
        [],
        [],
    ]


def test_each_rank_receives_only_its_worker_groups_share(batch):
    layouts = {
        "alpha": WorkerGroupLayout([0, 1]),
        "beta": WorkerGroupLayout([2, 3], tp=2),
        "gamma": WorkerGroupLayout([0]),
    }
    splits = {"alpha": BatchSplit(frozen_agents=frozenset({"w"})), "beta": BatchSplit()}  # gamma is frozen
    ranks = rank_batches(batch, splits, layouts, world_size=5)
    assert [list(r.shares) for r in ranks] == [["alpha"], ["alpha"], ["beta"], ["beta"], []]
    for rank in ranks[:2]:
        assert {p for m in rank.shares["alpha"].minis for p in m.rows.names("policy")} == {"alpha"}
    assert [_episodes(r.shares["alpha"]) for r in ranks[:2]] == [
        [["e0", "e4"]],
        [["e2", "e3"]],
    ]  # 5 | 5 tokens
    assert ranks[2].shares["beta"] is ranks[3].shares["beta"]  # TP peers: the same part
    assert _episodes(ranks[2].shares["beta"]) == [["e1", "e6"]]
    summary = ranks[0].summary
    assert all(r.summary == summary for r in ranks)
    assert summary.trained_policies == ("alpha", "beta") and summary.num_samples == 8
    assert summary.num_train_tokens == (4 + 2 + 3 + 1 + 6) + (
        2 + 3
    )  # prompt + response, frozen agent w included


def test_dp_rank_of_each_rank_follows_the_layout(batch):
    layout = WorkerGroupLayout([3, 2, 1, 0], tp=2)  # tp fastest: ranks 3, 2 are DP rank 0; 1, 0 DP rank 1
    ranks = rank_batches(batch, {"alpha": BatchSplit()}, {"alpha": layout}, world_size=4)
    assert ranks[3].shares["alpha"] is ranks[2].shares["alpha"] is not ranks[1].shares["alpha"]
    # by tokens: e5(6) -> 0, e0(4) -> 1, e3(3) -> 1, e2(2) -> 0, e4(1) -> 1; each part in row order
    assert _episodes(ranks[3].shares["alpha"]) == [["e2", "e5"]]
    assert _episodes(ranks[0].shares["alpha"]) == [["e0", "e3", "e4"]]


def test_a_batch_with_some_policies_only(batch):
    beta_only = batch.select(
        batch.policy == batch.vocab["policy"].index("beta")
    )  # fully_async: one policy ready
    layouts = {"alpha": WorkerGroupLayout([0]), "beta": WorkerGroupLayout([1])}
    ranks = rank_batches(beta_only, {"alpha": BatchSplit(), "beta": BatchSplit()}, layouts, world_size=2)
    assert [list(r.shares) for r in ranks] == [[], ["beta"]]
    assert ranks[0].summary.trained_policies == ("beta",) and ranks[0].summary.num_samples == 2
