"""The OpenEnv preset (configs/presets/openenv.yaml) trains 2 steps through ``scripts/train.py``: a
speaker and a listener sharing a tiny random Llama play Relay, an environment written for OpenEnv
(the openenv extra), and the rewards its observations carry reach the samples and the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "presets" / "openenv.yaml"
NUM_STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    pytest.importorskip("openenv", reason="the openenv extra (scripts/setup.sh --extras openenv)")
    run_dir, _, _ = train(
        CONFIG,
        tmp_path_factory.mktemp("openenv"),
        nproc=1,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        overrides=("name=run", f"trainer.total_steps={NUM_STEPS}"),
    )
    return run_dir


def test_a_team_trains_on_an_openenv_environment(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["policy/shared/grad_norm"] > 0 and row["weight_sync/shared/bytes"] > 0
        for role in ("speaker", "listener"):
            assert row[f"agent/{role}/num_samples"] > 0 and row[f"agent/{role}/response_len"] == 1.0
            assert row[f"agent/{role}/invalid_rate"] == 0  # digits only: every reply is a RelayAction
        # the team reward is the episode's return: the listener's 1.0 for a right guess, else 0.0
        assert row["rollout/team_reward_mean"] == pytest.approx(row["rollout/success_rate"])
        assert row["env/turns"] == 2.0 and row["env/unfinished"] == 0.0
    calls = [
        call
        for line in (run / "episodes" / "step_1.jsonl").read_text().splitlines()
        for call in json.loads(line)["calls"]
    ]
    assert {c["agent"] for c in calls} == {"speaker", "listener"}
    assert {c["local_reward"] for c in calls if c["agent"] == "speaker"} == {0.0}
    assert {c["local_reward"] for c in calls if c["agent"] == "listener"} <= {0.0, 1.0}
    evals = json.loads((run / "eval.json").read_text())
    assert [e["step"] for e in evals] == [0, NUM_STEPS]
    assert "agent/listener/success" in evals[-1]["results"]
