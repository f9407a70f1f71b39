"""A run whose rewards turn NaN (a crafted env) skips those updates, logs them, never pushes NaN
weights into the engine, and stops after ``trainer.max_nonfinite_updates`` in a row with a clear
error naming the last good checkpoint, which stays complete."""

import json
import math
from pathlib import Path

import pytest
import torch

from megamarl.orchestration.env import ENVS
from megamarl.orchestration.envs.signalling import SignallingEnv
from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
EPISODES_PER_STEP = 2 * 4  # rollout.num_tasks x rollout.group_size below


@ENVS.register("nan_after_two_steps")
class NanAfterTwoSteps(SignallingEnv):
    """Signalling whose team reward is NaN from the third training step on (episodes run in the
    driver process, in order, so a class counter knows the step)."""

    num_episodes = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        NanAfterTwoSteps.num_episodes += 1
        self.ordinal = NanAfterTwoSteps.num_episodes

    def team_reward(self) -> float:
        return float("nan") if self.ordinal > 2 * EPISODES_PER_STEP else super().team_reward()


def _run(rank, output_dir):
    from megamarl.cli.configure import load_config
    from megamarl.errors import NumericalFaultError
    from megamarl.trainer import Trainer

    cfg = load_config(
        ROOT / "configs/signalling_tiny.yaml",
        [
            "trainer.total_steps=8",
            "trainer.save_every=1",
            "rollout.num_tasks=2",
            "rollout.group_size=4",
            "eval.num_tasks=0",
            "env.name=nan_after_two_steps",
            f"output_dir={output_dir}",
        ],
    )
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    except NumericalFaultError as exc:
        error = str(exc)
    else:
        error = ""
    engine = trainer.driver.engines_for("shared")[0]
    finite = all(torch.isfinite(p).all() for p in engine.model.parameters())
    return error, trainer.step, finite


def test_three_nonfinite_updates_in_a_row_stop_the_run(tmp_path):
    from megamarl.runtime.checkpoint import list_checkpoints

    ((error, step, engine_finite),) = run_ranks(_run, 1, str(tmp_path), timeout_s=300)
    run_dir = tmp_path / "signalling_tiny"
    assert step == 4 and engine_finite  # steps 3, 4 skipped and saved; step 5's skip is the third
    assert "3 non-finite updates in a row (trainer.max_nonfinite_updates=3)" in error, error
    assert "non-finite loss in micro-batches of agents" in error
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_000004'}" in error
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step_00000{i}" for i in range(1, 5)]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy/shared/nonfinite_skipped"] for m in metrics] == [0.0, 0.0, 1.0, 1.0]
    assert all(math.isfinite(m["policy/shared/grad_norm"]) for m in metrics[:2])
