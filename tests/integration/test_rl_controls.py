"""Issue #27 item 3, the RL controls users of verl / OpenRLHF / PettingLLMs expect, each in a
``scripts/train.py`` run (one CPU rank, tiny models, 2 steps): per-agent stop strings and max_tokens
and the team_alpha schedule in one run; an algorithm per policy (GRPO-family next to GAE); tic-tac-toe
against an opponent pool of the learner's past versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SIGNALLING = ROOT / "configs" / "signalling_tiny.yaml"
LATE_LETTERS = list("NOPQRSTUVWXYZ")


def _train(config: Path, tmp_path: Path, *overrides: str) -> list[dict]:
    _, rows, _ = train(
        config,
        tmp_path,
        nproc=1,
        timeout=300,
        overrides=(
            "name=run",
            "trainer.total_steps=2",
            "eval.num_tasks=0",
            "rollout.num_tasks=4",
            "rollout.group_size=4",
            "logger.progress=false",
            *overrides,
        ),
    )
    return rows


def test_per_agent_stop_strings_max_tokens_and_team_alpha_schedule(tmp_path):
    """The sender writes up to 3 letters and stops at the first of N..Z (kept in the trained ids, cut
    from the text the env reads); the receiver keeps its one-token replies. The local-reward weight
    anneals linearly from team_alpha=1 to 0 over 2 steps: 1.0 at step 1, 0.5 at step 2."""
    rows = _train(
        SIGNALLING,
        tmp_path,
        "agents.sender.sampling.max_tokens=3",
        f"agents.sender.sampling.stop=[{','.join(LATE_LETTERS)}]",
        "logger.episodes_per_step=4",
        "algorithm.team_alpha_schedule={kind: linear, end: 0.0}",
    )
    assert [r["algorithm/team_alpha"] for r in rows] == [1.0, 0.5]
    assert all(1 < r["agent/sender/response_len"] <= 3 for r in rows)  # neither 1 token nor always 3
    assert all(r["agent/receiver/response_len"] == 1 for r in rows)
    calls = [
        c
        for step in (1, 2)
        for line in (tmp_path / "run" / "episodes" / f"step_{step}.jsonl").read_text().splitlines()
        for c in json.loads(line)["calls"]
        if c["agent"] == "sender"
    ]
    assert calls and not any(set(c["response"]) & set(LATE_LETTERS) for c in calls)
    assert any(len(c["response"]) < 3 for c in calls)  # a stop string ended (and cut) a reply


def test_two_policies_train_with_different_estimators(tmp_path):
    """L3 signalling on one rank: the sender's policy keeps the run's at_grpo, the receiver gets a
    policy of its own whose policies.<p>.algorithm is GAE with a critic (value head) in the same run."""
    critic = (
        "{model: tiny-plain-llama, lr: 1.0e-3, micro_batch_size: 64, dtype: fp32, "
        "engine: {backend: hf, dtype: fp32}, "
        "algorithm: {estimator: gae, estimator_kwargs: {gamma: 1.0, lam: 0.95}, value_loss_agg: "
        "seq-mean-token-sum}}"
    )
    rows = _train(
        SIGNALLING,
        tmp_path,
        f"+policies.critic={critic}",
        "agents.receiver.policy=critic",
        "policies.shared.engine.delta_sync=tensors",  # the trainer's in-process push path honours it
    )
    # every tensor's bytes moved in each step (Adam moves every element that had a gradient): the
    # delta pushes skip nothing and send what a full push sends
    assert [r["weight_sync/shared/tensors_skipped"] for r in rows] == [0.0, 0.0]
    assert rows[1]["weight_sync/shared/bytes"] == rows[1]["weight_sync/critic/bytes"] > 0
    assert "weight_sync/critic/tensors_skipped" not in rows[1]  # delta_sync off there
    for row in rows:
        assert row["policy/critic/vf_loss"] > 0 and "policy/shared/vf_loss" not in row
        assert "agent/sender/advantage_mean" in row and "agent/receiver/advantage_mean" not in row
        assert row["policy/shared/grad_norm"] > 0 and row["policy/critic/grad_norm"] > 0
    assert rows[1]["policy/critic/value_mean"] != 0.0  # the zero-initialised head has learned


@pytest.mark.slow
def test_tictactoe_against_an_opponent_pool_of_past_selves(tmp_path):
    """configs/tictactoe_pool.yaml with a snapshot every step and pick=latest: step 1's opponents are
    past_1 with alpha's initial weights (engine version 0, never pushed); after step 1 alpha's weights
    go into past_1 (a new version), after step 2 into past_2; step 2's opponents are past_1 at that new
    version (the snapshot serves the rollouts), and only alpha trains."""
    pytest.importorskip("pygame")  # pettingzoo.classic needs it (the pettingzoo extra installs it)
    rows = _train(
        ROOT / "configs" / "tictactoe_pool.yaml",
        tmp_path,
        "rollout.opponent_pool.every=1",
        "rollout.opponent_pool.pick=latest",
        "logger.episodes_per_step=8",
    )
    assert [r["opponent_pool/num_snapshots"] for r in rows] == [0, 1]  # taken before each step's rollout
    assert [r["opponent_pool/past_1/snapshot_step"] for r in rows] == [0, 1]
    assert rows[0]["weight_sync/past_1/bytes"] > 0 and rows[1]["weight_sync/past_2/bytes"] > 0
    assert all("policy/past_1/loss" not in r and r["policy/alpha/grad_norm"] > 0 for r in rows)
    opponents = {}
    for step in (1, 2):
        calls = [
            c
            for line in (tmp_path / "run" / "episodes" / f"step_{step}.jsonl").read_text().splitlines()
            for c in json.loads(line)["calls"]
        ]
        assert {c["policy"] for c in calls} == {"alpha", "past_1"}
        opponents[step] = {c["weight_version"] for c in calls if c["policy"] == "past_1"}
    assert opponents[1] == {0} and len(opponents[2]) == 1 and opponents[2] != {0}
