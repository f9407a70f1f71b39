"""SampleBatch: collate, select, split, balance, micro-batches, concat and a 2-rank gloo gather."""

import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamarl.rl.batch import ROW_TENSORS, TOKEN_TENSORS, SampleBatch, collate, concat
from megamarl.rl.sample import Sample

PAD = 0


def make(task, episode, agent, policy, turn, prompt_len, response_len, **kw):
    prompt = list(range(10, 10 + prompt_len))
    response = list(range(50, 50 + response_len))
    logprobs = [-0.5 * (i + 1) for i in range(response_len)]
    return Sample(
        task,
        episode,
        agent,
        policy,
        turn,
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=logprobs,
        **kw,
    )


def three():
    return [
        make("t0", "e0", "solver", "big", 0, 2, 3, team_reward=1.0, local_reward=0.5, anchor="obs"),
        make("t0", "e0", "verifier", "small", 0, 1, 1, valid=False, step=1),
        make("t1", "e1", "solver", "big", 1, 3, 2, branch=2, weight_version=4, truncated=True),
    ]


def test_collate_columns_tokens_masks_logprobs():
    b = collate(three(), PAD)
    assert b.vocab == {
        "task": ("t0", "t1"),
        "episode": ("e0", "e1"),
        "agent": ("solver", "verifier"),
        "policy": ("big", "small"),
    }
    assert b.task.tolist() == [0, 0, 1] and b.agent.tolist() == [0, 1, 0] and b.policy.tolist() == [0, 1, 0]
    assert b.turn.tolist() == [0, 0, 1] and b.branch.tolist() == [0, 0, 2] and b.step.tolist() == [0, 1, 0]
    assert b.weight_version.tolist() == [0, 0, 4]
    assert b.valid.tolist() == [True, False, True] and b.truncated.tolist() == [False, False, True]
    assert b.names("agent") == ["solver", "verifier", "solver"]
    assert b.tokens.tolist() == [[10, 11, 50, 51, 52], [10, 50, 0, 0, 0], [10, 11, 12, 50, 51]]
    assert b.attention_mask.int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert b.response_mask.int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 1]]
    assert b.rollout_logprobs.tolist() == [
        [0, 0, -0.5, -1.0, -1.5],
        [0, -0.5, 0, 0, 0],
        [0, 0, 0, -0.5, -1.0],
    ]
    assert b.team_rewards.tolist() == [1.0, 0, 0] and b.rewards.tolist() == [1.5, 0, 0]
    assert b.anchors == ("obs", None, None)
    assert b.num_tokens == 12 and b.lengths.tolist() == [5, 2, 5]
    idx = b.group_index()
    assert idx.task.tolist() == [0, 0, 1] and idx.anchors == ("obs", None, None)


def test_select_mask_and_indices_trim_width():
    b = collate(three(), PAD).replace(advantages=torch.arange(15.0).view(3, 5))
    s = b.select(torch.tensor([False, True, False]))
    assert s.tokens.tolist() == [[10, 50]] and s.advantages.tolist() == [[5.0, 6.0]]
    assert s.vocab == b.vocab and s.names("policy") == ["small"]
    s = b.select([2, 0])
    assert s.tokens.shape == (2, 5) and s.task.tolist() == [1, 0] and s.anchors == (None, "obs")
    empty = b.select([])
    assert empty.tokens.shape == (0, 0) and empty.num_samples == 0


def test_split_by_policy():
    parts = collate(three(), PAD).split_by_policy()
    assert list(parts) == ["big", "small"]
    assert parts["big"].tokens.shape == (2, 5) and parts["big"].turn.tolist() == [0, 1]
    assert parts["small"].tokens.tolist() == [[10, 50]]


def _lengths_batch(lengths):
    return collate([make("t", f"e{i}", "a", "p", 0, 1, n - 1) for i, n in enumerate(lengths)], PAD)


def test_balance_lpt_deterministic():
    b = _lengths_batch([5, 1, 4, 2, 3, 3])
    # LPT: 5->r0, 4->r1, 3(i4)->r1, 3(i5)->r0, 2->r1, 1->r0  => r0 {0,1,5}=9 tokens, r1 {2,3,4}=9 tokens
    parts = b.balance_across_dp(2)
    assert [p.episode.tolist() for p in parts] == [[0, 1, 5], [2, 3, 4]]
    assert [p.num_tokens for p in parts] == [9, 9]
    assert [p.tokens.shape for p in parts] == [(3, 5), (3, 4)]


def test_balance_every_rank_gets_a_sample():
    parts = _lengths_batch([10, 1, 1]).balance_across_dp(3)
    assert [p.episode.tolist() for p in parts] == [[0], [1], [2]]
    parts = _lengths_batch([3, 2]).balance_across_dp(3)
    assert [p.num_samples for p in parts] == [1, 1, 0]


def test_micro_batches_by_samples_and_padded_tokens():
    b = _lengths_batch([2, 5, 3, 3, 1])
    assert [m.episode.tolist() for m in b.micro_batches(max_samples=2)] == [[0, 1], [2, 3], [4]]
    by_tokens = b.micro_batches(max_tokens=10)  # 2x5=10 fits, then 3x3=9
    assert [m.episode.tolist() for m in by_tokens] == [[0, 1], [2, 3, 4]]
    assert [tuple(m.tokens.shape) for m in by_tokens] == [(2, 5), (3, 3)]
    # a row longer than max_tokens goes alone
    assert [m.episode.tolist() for m in b.micro_batches(max_tokens=4)] == [[0], [1], [2], [3], [4]]
    both = b.micro_batches(max_samples=2, max_tokens=9)
    assert [m.episode.tolist() for m in both] == [[0], [1], [2, 3], [4]]
    with pytest.raises(ValueError):
        b.micro_batches()


def test_concat_merges_vocab_and_repads():
    a = collate(three()[1:2], PAD).replace(advantages=torch.tensor([1.0]))
    b = collate(three(), PAD).replace(advantages=torch.tensor([2.0, 3, 4]))
    c = concat([a, b])
    assert c.vocab["policy"] == ("small", "big") and c.names("policy") == ["small", "big", "small", "big"]
    assert c.tokens.shape == (4, 5) and c.tokens[0].tolist() == [10, 50, 0, 0, 0]
    assert c.advantages.tolist() == [1.0, 2, 3, 4]
    assert concat([a, b.replace(advantages=None)]).advantages is None


# Two tokenizer families in one L3 team: a Llama-family policy ("big", SmolLM2's pad id 2) and a
# Qwen-family one ("small", its own tokenizer's <|endoftext|> = 512).
FAMILY_PADS = {"big": 2, "small": 512}


def test_each_policy_rows_are_padded_with_its_own_pad_id():
    b = collate(three(), FAMILY_PADS)
    assert b.pad_ids == FAMILY_PADS
    assert b.tokens.tolist() == [[10, 11, 50, 51, 52], [10, 50, 512, 512, 512], [10, 11, 12, 50, 51]]
    # a policy's part (what its worker group trains on) keeps its own pad id in its padding
    small = collate([*three(), make("t2", "e2", "verifier", "small", 0, 2, 2)], FAMILY_PADS)
    assert small.split_by_policy()["small"].tokens.tolist() == [[10, 50, 512, 512], [10, 11, 50, 51]]
    big = collate([make("t3", "e3", "solver", "big", 0, 1, 1), *three()], FAMILY_PADS)
    assert big.split_by_policy()["big"].tokens.tolist() == [
        [10, 50, 2, 2, 2],
        [10, 11, 50, 51, 52],
        [10, 11, 12, 50, 51],
    ]
    with pytest.raises(ValueError, match="policy 'small' has no pad id"):
        collate(three(), {"big": 2})


def test_concat_repads_each_row_with_its_policy_pad_id():
    wide = collate([make("t2", "e2", "verifier", "small", 0, 4, 3)], {"small": 512})
    c = concat([collate(three(), FAMILY_PADS), wide])
    assert c.pad_ids == FAMILY_PADS
    assert c.tokens.tolist() == [
        [10, 11, 50, 51, 52, 2, 2],
        [10, 50, 512, 512, 512, 512, 512],
        [10, 11, 12, 50, 51, 2, 2],
        [10, 11, 12, 13, 50, 51, 52],
    ]
    with pytest.raises(ValueError, match="policy 'small' is padded with 512 in one batch and 0 in another"):
        concat([collate(three(), FAMILY_PADS), collate(three()[1:2], PAD)])


def gather_across_ranks(batch: SampleBatch, group=None) -> SampleBatch:
    """All-gather every rank's batch (CPU copies, pickled) and ``concat`` them in rank order (moved
    here from megamarl/rl/batch.py: only this test used it)."""
    cpu = batch.replace(
        **{c: getattr(batch, c).cpu() for c in ROW_TENSORS + TOKEN_TENSORS},
        advantages=None if batch.advantages is None else batch.advantages.cpu(),
    )
    parts: list[SampleBatch | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, cpu, group=group)
    return concat(parts)


def _gather_worker(rank, world, init, out_dir):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    samples = three() if rank == 0 else [make("t9", "e9", "planner", "small", 0, 6, 1)]
    gathered = gather_across_ranks(collate(samples, PAD))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(gathered, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_gather_across_ranks_gloo(tmp_path):
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_gather_worker, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            g = pickle.load(f)
        assert g.num_samples == 4 and g.tokens.shape == (4, 7)
        assert g.names("task") == ["t0", "t0", "t1", "t9"]
        assert g.names("policy") == ["big", "small", "big", "small"]
        assert g.vocab["agent"] == ("solver", "verifier", "planner")
        assert g.tokens[3].tolist() == [10, 11, 12, 13, 14, 15, 50]
        assert g.tokens[1].tolist() == [10, 50, 0, 0, 0, 0, 0]


def test_group_sizes_and_the_trained_groups_record():
    from megamarl.runtime.transcripts import trained_groups

    b = collate(
        [
            *three(),
            make("t1", "e2", "solver", "big", 1, 1, 1),
            make("t1", "e3", "verifier", "small", 0, 1, 1),
        ],
        PAD,
    )
    assert b.group_sizes(("task", "agent", "turn")) == {
        ("t0", "solver", 0): 1,
        ("t0", "verifier", 0): 1,
        ("t1", "solver", 1): 2,
        ("t1", "verifier", 0): 1,
    }
    assert b.group_sizes(("task",)) == {("t0",): 2, ("t1",): 3}
    assert b.group_sizes(()) == {(): 5}
    # each policy under its own estimator's key (policies.<p>.algorithm may differ)
    assert trained_groups(b, {"big": ("task", "agent", "turn"), "small": ("task",)}) == {
        "big": {"key": ["task", "agent", "turn"], "groups": [["t0", "solver", 0, 1], ["t1", "solver", 1, 2]]},
        "small": {"key": ["task"], "groups": [["t0", 1], ["t1", 1]]},
    }
