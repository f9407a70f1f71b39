"""TextArena's TicTacToe trains through ``scripts/train.py`` (configs/presets/textarena.yaml: one tiny
policy against an opponent pool of its own snapshots, hf engines, 1 rank), 2 steps: the learner's
moves train it, the pool takes a snapshot after step 1, and TextArena's rewards, winners and invalid
moves reach the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "presets" / "textarena.yaml"
NUM_STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    pytest.importorskip("textarena")  # the textarena extra (CI installs it)
    run_dir, _, _ = train(
        CONFIG,
        tmp_path_factory.mktemp("textarena"),
        nproc=1,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        overrides=("name=run", f"trainer.total_steps={NUM_STEPS}", "logger.progress=false"),
    )
    return run_dir


def test_self_play_against_the_pool_trains_on_textarenas_rewards(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["policy/alpha/grad_norm"] > 0 and row["weight_sync/alpha/bytes"] > 0
        # competitive: no team reward; a seat's reward is TextArena's (+1 won, -1 lost or forfeited, 0 draw)
        assert row["rollout/team_reward_mean"] == 0.0
        for seat in ("player_0", "player_1"):
            assert row[f"agent/{seat}/num_samples"] > 0 and row[f"agent/{seat}/response_len"] == 1.0
            assert -1.0 <= row[f"agent/{seat}/reward_min"] <= row[f"agent/{seat}/reward_max"] <= 1.0
            assert 0 <= row[f"agent/{seat}/invalid_rate"] < 1  # occupied cells, as TextArena reports them
        # one winner per decisive game: the seats' win rates add up to the decisive share
        seats = row["agent/player_0/success"] + row["agent/player_1/success"]
        assert seats == pytest.approx(row["rollout/success_rate"])
        assert 3 <= row["env/turns"] <= 24  # the shortest game: a move, then two invalid replies
        assert row["env/unfinished"] == 0.0
    # the pool: alpha's weights reach slot past_1 after step 1, the snapshots play but never train
    assert rows[0]["opponent_pool/num_snapshots"] == 0 and rows[1]["opponent_pool/past_1/snapshot_step"] == 1
    assert not any(k.startswith(("policy/past_1/grad_norm", "policy/past_2/grad_norm")) for k in rows[-1])
    evals = json.loads((run / "eval.json").read_text())
    assert [e["step"] for e in evals] == [0, NUM_STEPS]
    assert "agent/player_0/success" in evals[-1]["results"]
