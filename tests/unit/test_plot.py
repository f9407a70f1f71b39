"""plot_run draws PNGs from a synthetic run directory (metrics.jsonl + eval.json)."""

from __future__ import annotations

import math

import pytest

from megamarl.runtime.metrics import LoggerConfig, WandbConfig
from megamarl.runtime.metrics import MetricsLogger
from megamarl.runtime.plot import main, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_synthetic_run(run_dir, *, num_steps: int = 40) -> None:
    cfg = LoggerConfig(wandb=WandbConfig(mode="disabled"), progress=False)
    with MetricsLogger(run_dir, cfg, "synthetic", rank=0) as logger:
        for step in range(num_steps):
            wiggle = 0.05 * math.sin(step * 1.7)
            logger.log(step, {
                "agent/planner/reward_mean": 0.2 + 0.5 * step / num_steps + wiggle,
                "agent/executor/reward_mean": 0.1 + 0.3 * step / num_steps - wiggle,
                "agent/planner/success": min(1.0, 0.1 + step / num_steps),
                "agent/executor/success": 0.05 + 0.5 * step / num_steps,
                "agent/planner/pg_loss": -0.01 * wiggle,
                "agent/executor/response_len": 120 - step,
                "policy/planner/grad_norm": 1.0 / (1 + step),
                "kl": 0.001 * step, "entropy": 1.2 - 0.01 * step, "clip_frac": 0.05,
                "invalid_rate": 0.2 * 0.95**step,
                "timing/rollout_s": 30 + 3 * wiggle, "timing/logprob_s": 4.0, "timing/update_s": 12.0,
                "timing/weight_sync_s": 2.5, "timing/idle_s": 1.0, "timing/step_s": 49.5 + 3 * wiggle,
            })
            if step % 10 == 0 or step == num_steps - 1:
                progress_ = step / num_steps
                logger.log_eval(step, {"accuracy": 0.2 + 0.4 * progress_, "pass@4": 0.35 + 0.4 * progress_})


def test_plot_run_writes_pngs(tmp_path):
    write_synthetic_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["rewards.png", "timing.png", "training.png", "eval.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots" and path.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_eval_or_timing(tmp_path):
    cfg = LoggerConfig(wandb=WandbConfig(mode="disabled"), progress=False)
    with MetricsLogger(tmp_path, cfg, "r", rank=0) as logger:
        logger.log(0, {"agent/solver/reward_mean": 0.1})
        logger.log(1, {"agent/solver/reward_mean": 0.3})
    assert [p.name for p in plot_run(tmp_path)] == ["rewards.png"]


def test_cli(tmp_path, capsys):
    write_synthetic_run(tmp_path, num_steps=3)
    main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert "rewards.png" in capsys.readouterr().out and (tmp_path / "out" / "eval.png").is_file()


def test_missing_metrics_names_the_dir(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_run(tmp_path)
