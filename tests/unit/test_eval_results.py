"""``EvalConfig.result_keys`` (what ``eval.stop_at`` is checked against at load) names exactly the keys
``eval_summary`` writes into an eval.json entry: the two are written apart and must not drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from megamarl.cli.configure import load_config
from megamarl.config import EvalConfig
from megamarl.driver.rollout_driver import eval_summary
from megamarl.orchestration.episodes import EpisodeStats, RolloutResult

ROOT = Path(__file__).resolve().parents[2]


def test_result_keys_are_the_keys_of_an_eval_summary():
    cfg = load_config(ROOT / "configs" / "signalling_tiny.yaml", ["eval.k=3"])
    episodes = [
        EpisodeStats(
            task_id=f"t{i % 2}",
            episode_id=str(i),
            status="ok" if i else "failed",
            success=i % 3 == 0,
            agent_success={"sender": True, "receiver": i % 2 == 0},
            policies={"sender": "shared", "receiver": "shared"},
        )
        for i in range(6)
    ]
    summary = eval_summary(RolloutResult(samples=[], episodes=episodes), k=3)
    assert sorted(cfg.eval.result_keys(cfg.agents)) == sorted(summary)


def test_stop_at_names_the_keys_it_knows():
    cfg = load_config(ROOT / "configs" / "signalling_tiny.yaml")
    with pytest.raises(
        ValueError,
        match=r"eval.stop_at has unknown eval results \['team_acc'\]; eval.json holds "
        r"\['team_accuracy', 'avg@1', 'pass@1'",
    ):
        EvalConfig(num_tasks=4, stop_at={"team_acc": 0.9}).check_stop_at(cfg.agents)
