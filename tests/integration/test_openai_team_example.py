"""examples/openai_team trains through scripts/train.py in CI size: a tiny model, two steps, the
program (official ``openai`` client) run once per episode by the ``external`` orchestra; and its
long-lived form (team_workers.py, ``orchestra.kwargs.mode=long_lived``): two programs started once
for the whole run, each serving episodes one after another."""

import pytest
from train_runs import ROOT, train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONFIG = ROOT / "examples" / "openai_team" / "openai_team.yaml"
TINY = (
    "policies.shared.model=tiny-random-llama",
    "policies.shared.ranks=[0]",
    "policies.shared.engine.backend=hf",
    "rollout.num_tasks=2",
    "rollout.group_size=2",
    "eval.num_tasks=0",
    "trainer.total_steps=2",
    "name=run",
)


def _steps(tmp_path, *overrides: str) -> list[dict]:
    """The metrics row of each of the two training steps of the example's config, made tiny."""
    _, rows, output = train(
        CONFIG,
        tmp_path,
        nproc=1,
        timeout=300,
        overrides=(*TINY, *overrides),
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    steps = [r for r in rows if "rollout/num_episodes" in r]
    assert len(steps) == 2 and "training stopped" not in output, output[-3000:]
    for row in steps:
        assert row["rollout/num_episodes"] == 4 and row["rollout/num_failed"] == 0
        assert row["agent/solver/num_calls"] >= 4 and row["agent/verifier/num_calls"] >= 4
        assert "rollout/team_reward_mean" in row and "agent/verifier/reward_mean" in row
    return steps


def test_openai_team_example_trains_two_steps(tmp_path):
    steps = _steps(tmp_path)
    # a program per episode: 4 episodes a step
    assert [row["orchestra/program_starts"] for row in steps] == [4.0, 8.0]


def test_long_lived_team_trains_two_steps(tmp_path):
    steps = _steps(
        tmp_path,
        "orchestra.kwargs.mode=long_lived",
        "orchestra.kwargs.num_workers=2",
        "orchestra.kwargs.command=[python,examples/openai_team/team_workers.py]",
    )
    # started once per worker for the whole run: 8 episodes, 2 programs
    assert [row["orchestra/program_starts"] for row in steps] == [2.0, 2.0]
