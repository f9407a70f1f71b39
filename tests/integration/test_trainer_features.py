"""Trainer features end to end on one CPU rank (2 steps each, tiny models): L2 LoRA with per-agent
learning rates and a KL to the base; GAE with a critic (value head, its own loss aggregation) and its
checkpoint, plus the episode transcripts that run writes; two engine replicas as one pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SIGNALLING = ROOT / "configs" / "signalling_tiny.yaml"


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    _, rows, _ = train(
        SIGNALLING,
        tmp_path,
        nproc=1,
        timeout=300,
        overrides=(
            "name=run",
            "trainer.total_steps=2",
            "trainer.resume=none",
            "eval.num_tasks=0",
            "rollout.num_tasks=4",
            "rollout.group_size=4",
            "logger.progress=false",
            *overrides,
        ),
    )
    return rows


def test_l2_lora_adapters_train_per_agent_and_sync_adapter_only(tmp_path):
    rows = _train(
        tmp_path,
        "policies.shared.lora={rank: 4, alpha: 8}",
        "agents.sender.lora=sender",
        "agents.receiver.lora=receiver",
        "agents.sender.lr=0.002",
        "agents.receiver.kl_coef=0.1",
        "logger.trained_groups=false",
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert not (tmp_path / "run" / "trained_groups.jsonl").exists()  # written by default (test_async_resume)
    for row in rows:
        for adapter in ("sender", "receiver"):
            sent = row[f"weight_sync/shared/{adapter}/bytes"]
            assert 0 < sent < 200_000  # rank-4 adapters (~64 KB), not the 13 MB model
        # the base never moves: the push is both adapters (each stepped), and nothing else
        assert row["weight_sync/shared/bytes"] == sum(
            row[f"weight_sync/shared/{a}/bytes"] for a in ("sender", "receiver")
        )
        assert row["weight_sync/shared/adapters_pushed"] == 2
    assert rows[1]["policy/shared/kl_loss"] > 0  # the receiver's adapter moved away from the base
    adapters = tmp_path / "run" / "adapters" / "shared"
    assert {p.name for p in adapters.iterdir()} == {"receiver", "sender"}
    assert (
        adapters / "sender" / "v0" / "adapter_config.json"
    ).is_file()  # written at registration (version 0)


def test_gae_critic_trains_a_value_head_and_checkpoints_it(tmp_path):
    rows = _train(
        tmp_path,
        "algorithm.estimator=gae",
        "algorithm.estimator_kwargs={gamma: 1.0, lam: 0.95}",
        "algorithm.value_loss_agg=seq-mean-token-sum",
        "trainer.save_every=2",
        "logger.episodes_per_step=3",
    )
    assert all(r["policy/shared/vf_loss"] > 0 for r in rows)
    assert rows[1]["policy/shared/value_mean"] != 0.0  # the zero-initialised head has learned
    assert (
        tmp_path / "run" / "checkpoints" / "step_000002" / "policies" / "shared" / "value_head.pt"
    ).is_file()
    _check_episode_transcripts(tmp_path / "run")


def _check_episode_transcripts(run_dir: Path) -> None:
    """Issue #27 item 4 on the run above (no run of its own, to keep the suite's time): each step's
    transcripts, logger.episodes_per_step=3 episodes of different tasks, and show_episodes.py on them."""
    for step in (1, 2):
        records = [
            json.loads(line)
            for line in (run_dir / "episodes" / f"step_{step}.jsonl").read_text().splitlines()
        ]
        assert len(records) == 3 and len({r["task_id"] for r in records}) == 3
        for r in records:
            assert r["step"] == step and r["status"] == "ok" and isinstance(r["success"], bool)
            assert [c["agent"] for c in r["calls"]] == ["sender", "receiver"]  # the signalling game's order
            for c in r["calls"]:
                assert c["agent"] in c["prompt"] and c["response"] and c["weight_version"] == step
                assert c["action"] is None or c["action"] == c["response"].strip()
            assert r["team_reward"] == float(r["success"])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "show_episodes.py"), str(run_dir), "--agent", "receiver"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{run_dir} step 2: 3 episodes") and proc.stdout.count("=== episode") == 3
    assert "receiver (policy shared" in proc.stdout and "sender (policy" not in proc.stdout


def test_two_engine_replicas_are_one_pool_serving_episodes_and_adapters(tmp_path):
    """engine.num_replicas=2: the driver holds one EnginePool per policy (it used to hand the episodes
    a Python list, and every episode failed); L2 adapters are registered with and synced into both."""
    rows = _train(
        tmp_path,
        "policies.shared.engine.num_replicas=2",
        "policies.shared.lora={rank: 4, alpha: 8}",
        "agents.sender.lora=sender",
        "agents.receiver.lora=receiver",
    )
    for row in rows:
        assert row["rollout/num_failed"] == 0 and row["agent/sender/num_samples"] == 16
        assert row["weight_sync/shared/sender/bytes"] > 0
