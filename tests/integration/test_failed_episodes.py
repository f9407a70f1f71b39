"""Silent failures: evaluation episodes that crash are reported as failures with their first
traceback (eval.json marks the set failed instead of scoring it 0.000), and a failed-episode
fraction above ``rollout.max_failed_fraction`` stops the run with that error."""

import json
from pathlib import Path

import pytest

from megamarl.orchestration.env import ENVS
from megamarl.orchestration.envs.signalling import SignallingEnv
from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


@ENVS.register("broken_eval_signalling")
class BrokenEval(SignallingEnv):
    """Signalling whose held-out (eval) tasks crash in ``step`` like a buggy env would."""

    def step(self, agent, action):
        if self.task.task_id.startswith("signal-1000000007-"):  # the eval task seed (trainer.py)
            return self.missing_attribute  # AttributeError
        return super().step(agent, action)


def _run(rank, output_dir):
    from megamarl.cli.configure import load_config
    from megamarl.errors import RolloutFailureError
    from megamarl.trainer import Trainer

    base = [
        "trainer.total_steps=1",
        "rollout.num_tasks=2",
        "rollout.group_size=4",
        "eval.num_tasks=4",
        "env.name=broken_eval_signalling",
    ]
    tolerant = Trainer(
        load_config(
            ROOT / "configs/signalling_tiny.yaml",
            [*base, "rollout.max_failed_fraction=1.0", f"output_dir={output_dir}/tolerant"],
        )
    )
    tolerant.fit()  # every eval episode fails, training episodes do not
    strict = Trainer(
        load_config(ROOT / "configs/signalling_tiny.yaml", [*base, f"output_dir={output_dir}/strict"])
    )
    try:
        strict.fit()
        error = ""
    except RolloutFailureError as exc:
        error = str(exc)
    return tolerant.step, strict.step, error


def test_failed_eval_is_reported_and_bounded(tmp_path):
    ((tolerant_step, strict_step, error),) = run_ranks(_run, 1, str(tmp_path), timeout_s=300)
    entries = json.loads((tmp_path / "tolerant" / "signalling_tiny" / "eval.json").read_text())
    assert tolerant_step == 1 and [e["step"] for e in entries] == [0, 1]
    for entry in entries:
        assert entry["failed"] is True and entry["results"]["num_failed"] == 4.0
        assert "4/4 episodes failed {'error:AttributeError': 4}" in entry["error"]
        assert "AttributeError: 'BrokenEval' object has no attribute 'missing_attribute'" in entry["error"]
        assert "Traceback (most recent call last)" in entry["error"]
    # the default bound (0.5) stops the run at the first evaluation, before any training step
    assert strict_step == 0
    assert error.startswith(
        "eval step 0: 4/4 episodes failed {'error:AttributeError': 4}; first: episode signal-1000000007-0/0"
    )
    assert error.endswith("(failed fraction 1.000 > rollout.max_failed_fraction=0.5)")
