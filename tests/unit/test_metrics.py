"""MetricsLogger (JSONL, eval.json, wandb offline/disabled), aggregation helpers, Timer, progress."""

from __future__ import annotations

import json
import math

import pytest

from megamarl.config_sections import LoggerConfig, WandbConfig
from megamarl.runtime.metrics import (
    MetricsLogger,
    Timer,
    agent_metrics,
    describe,
    mean,
    progress,
    read_eval,
    read_metrics,
)


def _cfg(mode: str) -> LoggerConfig:
    return LoggerConfig(wandb=WandbConfig(mode=mode), progress=False)


def test_jsonl_records_are_exact(tmp_path):
    with MetricsLogger(tmp_path, _cfg("disabled"), "r", {"a": 1}, rank=0) as logger:
        logger.log(0, {"agent/planner/reward_mean": 0.5, "kl": 0.25})
        logger.log(1, {"agent/planner/reward_mean": 0.75, "entropy": float("nan")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert list(first) == ["step", "time", "elapsed_s", "agent/planner/reward_mean", "kl"]
    assert (first["step"], first["agent/planner/reward_mean"], first["kl"]) == (0, 0.5, 0.25)
    assert second == {**second, "step": 1, "agent/planner/reward_mean": 0.75, "entropy": None}  # NaN -> null
    assert first["time"] <= second["time"] and second["elapsed_s"] >= 0
    assert read_metrics(tmp_path)[1]["step"] == 1
    assert not (tmp_path / "wandb").exists()  # disabled: no wandb files


def test_eval_json_is_a_list_rewritten_per_call(tmp_path):
    with MetricsLogger(tmp_path, _cfg("disabled"), "r", rank=0) as logger:
        logger.log_eval(0, {"accuracy": 0.25})
        logger.log_eval(10, {"accuracy": 0.5, "pass@4": 0.75})
    entries = json.loads((tmp_path / "eval.json").read_text())
    assert [(e["step"], e["results"]) for e in entries] == [
        (0, {"accuracy": 0.25}),
        (10, {"accuracy": 0.5, "pass@4": 0.75}),
    ]
    assert read_eval(tmp_path) == entries
    assert not list(tmp_path.glob("*.tmp"))


def test_only_rank_zero_writes(tmp_path):
    logger = MetricsLogger(tmp_path / "run", _cfg("offline"), "r", rank=3)
    logger.log(0, {"kl": 1.0})
    logger.log_eval(0, {"accuracy": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_wandb_offline_run_lives_inside_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "")  # offline must never need an account
    config = {"policies": {"p": {"lr": 1e-6}}}
    logger = MetricsLogger(tmp_path, _cfg("offline"), "offline-test", config, rank=0)
    try:
        assert logger.wandb_run is not None and logger.wandb_run.settings.mode == "offline"
        logger.log(0, {"agent/a/reward_mean": 1.0})
        logger.log_eval(0, {"accuracy": 0.5})
    finally:
        logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_mode_is_validated():
    with pytest.raises(ValueError, match="logger.wandb.mode"):
        WandbConfig(mode="cloud")


def test_aggregation_helpers():
    per_agent = {"planner": {"reward_mean": [1.0, 0.0], "success": [1, 1]}, "executor": {"pg_loss": [2.0]}}
    assert agent_metrics(per_agent) == {
        "agent/planner/reward_mean": 0.5,
        "agent/planner/success": 1.0,
        "agent/executor/pg_loss": 2.0,
    }
    assert describe("reward", [1.0, 3.0]) == {
        "reward_mean": 2.0,
        "reward_std": 1.0,
        "reward_min": 1.0,
        "reward_max": 3.0,
    }
    assert math.isnan(mean([]))


def test_timer_accumulates_and_derives_idle():
    timer = Timer()
    timer.add("rollout", 2.0)
    timer.add("rollout", 1.0)
    timer.add("update", 4.0)
    timer.add("step", 10.0)
    assert timer.pop() == {
        "timing_s/rollout": 3.0,
        "timing_s/update": 4.0,
        "timing_s/step": 10.0,
        "timing_s/idle": 3.0,
    }
    assert timer.pop() == {}
    with timer("weight_sync"):
        pass
    assert set(timer.metrics()) == {"timing_s/weight_sync"} and timer.metrics()["timing_s/weight_sync"] >= 0


def test_progress_is_silent_without_a_tty(capsys):
    with progress(3, "rollout") as bar:  # pytest captures stderr: not a TTY
        bar.advance()
        bar.update(completed=3)
    with progress(3, "update", enabled=False) as bar:
        bar.advance(2)
    assert capsys.readouterr().err == ""
