"""The reasoning-gym preset (configs/presets/reasoning_gym.yaml) trains 2 steps through
``scripts/train.py``: a solver and a verifier sharing a tiny random Llama on reasoning-gym's chain_sum
and leg_counting generators, scored by reasoning-gym's own ``score_answer`` (the reasoning-gym extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "presets" / "reasoning_gym.yaml"
NUM_STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    pytest.importorskip(
        "reasoning_gym", reason="the reasoning-gym extra (scripts/setup.sh --extras reasoning-gym)"
    )
    out = tmp_path_factory.mktemp("reasoning_gym")
    run_dir, rows, _ = train(
        CONFIG,
        out,
        nproc=1,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        overrides=("name=run", f"trainer.total_steps={NUM_STEPS}"),
    )
    return run_dir, rows


def test_solver_and_verifier_train_on_reasoning_gym_tasks(run):
    run_dir, rows = run
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["policy/shared/grad_norm"] > 0 and row["weight_sync/shared/bytes"] > 0
        for agent in ("solver", "verifier"):
            assert row[f"agent/{agent}/num_samples"] > 0
            assert row[f"agent/{agent}/invalid_rate"] == 0  # constrained decoding: every reply parses
        assert 0.0 <= row["rollout/team_reward_mean"] <= 1.0  # reasoning-gym's scores are in [0, 1]
        assert row["env/score_errors"] == 0  # the env's own metric reached the log
    calls = [
        (episode["task_id"], call)
        for line in (run_dir / "episodes" / "step_1.jsonl").read_text().splitlines()
        for episode in [json.loads(line)]
        for call in episode["calls"]
    ]
    assert {task_id.rsplit("-", 1)[-1] for task_id, _ in calls} <= {"chain_sum", "leg_counting"}
    for _, call in calls:  # the solver's local reward is its score, the verifier's a verdict match
        allowed = (0.0, 1.0) if call["agent"] == "verifier" else None
        assert 0.0 <= call["local_reward"] <= 1.0 and (allowed is None or call["local_reward"] in allowed)
    evals = json.loads((run_dir / "eval.json").read_text())
    assert [e["step"] for e in evals] == [0, NUM_STEPS]
    assert (run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "COMPLETE").is_file()
