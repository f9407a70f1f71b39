"""Trainer features end to end on one CPU rank (2 steps each, tiny models): L2 LoRA with per-agent
learning rates and a KL to the base; GAE with a critic (value head) and its checkpoint; two engine
replicas as one pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SIGNALLING = ROOT / "configs" / "signalling_tiny.yaml"


def _train(tmp_path: Path, *overrides: str, port: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
        str(ROOT / "scripts" / "train.py"), "--config", str(SIGNALLING), f"output_dir={tmp_path}", "name=run",
        "trainer.total_steps=2", "trainer.resume=none", "eval.num_tasks=0", "rollout.num_tasks=4", "rollout.group_size=4",
        "logger.progress=false", *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "CI": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_l2_lora_adapters_train_per_agent_and_sync_adapter_only(tmp_path):
    rows = _train(
        tmp_path, "policies.shared.lora={rank: 4, alpha: 8}", "agents.sender.lora=sender",
        "agents.receiver.lora=receiver", "agents.sender.lr=0.002", "agents.receiver.kl_coef=0.1", port=29831,
    )
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for adapter in ("sender", "receiver"):
            sent = row[f"weight_sync/shared/{adapter}/bytes"]
            assert 0 < sent < 200_000  # rank-4 adapters (~64 KB), not the 13 MB model
        assert "weight_sync/shared/bytes" not in row
    assert rows[1]["policy/shared/kl_loss"] > 0  # the receiver's adapter moved away from the base
    adapters = tmp_path / "run" / "adapters" / "shared"
    assert {p.name for p in adapters.iterdir()} == {"receiver", "sender"}
    assert (adapters / "sender" / "v0" / "adapter_config.json").is_file()  # written at registration (version 0)


def test_gae_critic_trains_a_value_head_and_checkpoints_it(tmp_path):
    rows = _train(tmp_path, "algorithm.estimator=gae", "algorithm.estimator_kwargs={gamma: 1.0, lam: 0.95}",
                  "trainer.save_every=2", port=29832)
    assert all(r["policy/shared/vf_loss"] > 0 for r in rows)
    assert rows[1]["policy/shared/value_mean"] != 0.0  # the zero-initialised head has learned
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "policies" / "shared" / "value_head.pt").is_file()


def test_two_engine_replicas_are_one_pool_serving_episodes_and_adapters(tmp_path):
    """engine.num_replicas=2: the driver holds one EnginePool per policy (it used to hand the episodes
    a Python list, and every episode failed); L2 adapters are registered with and synced into both."""
    rows = _train(tmp_path, "policies.shared.engine.num_replicas=2", "policies.shared.lora={rank: 4, alpha: 8}",
                  "agents.sender.lora=sender", "agents.receiver.lora=receiver", port=29833)
    for row in rows:
        assert row["rollout/num_failed"] == 0 and row["agent/sender/num_samples"] == 16
        assert row["weight_sync/shared/sender/bytes"] > 0
