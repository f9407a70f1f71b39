"""examples/openai_team trains through scripts/train.py in CI size: a tiny model, two steps, the
program (official ``openai`` client) run once per episode by the ``external`` orchestra."""

import pytest
from train_runs import ROOT, train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONFIG = ROOT / "examples" / "openai_team" / "openai_team.yaml"


def test_openai_team_example_trains_two_steps(tmp_path):
    overrides = (
        "policies.shared.model=tiny-random-llama",
        "policies.shared.ranks=[0]",
        "policies.shared.engine.backend=hf",
        "rollout.num_tasks=2",
        "rollout.group_size=2",
        "eval.num_tasks=0",
        "trainer.total_steps=2",
        "name=run",
    )
    run_dir, rows, output = train(
        CONFIG,
        tmp_path,
        nproc=1,
        timeout=300,
        overrides=overrides,
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    steps = [r for r in rows if "rollout/num_episodes" in r]
    assert len(steps) == 2, output[-3000:]
    for row in steps:
        assert row["rollout/num_episodes"] == 4 and row["rollout/num_failed"] == 0
        assert row["agent/solver/num_calls"] >= 4 and row["agent/verifier/num_calls"] >= 4
    assert (run_dir / "metrics.jsonl").exists() and "training stopped" not in output
