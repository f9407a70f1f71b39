"""plot_run draws PNGs from a synthetic run directory (metrics.jsonl + eval.json): one figure per
concern, every axis labelled, agents in one colour across figures, eval sets as separate lines with
base-model references, counts never on a rate axis; older runs (``timing/*_s``) still plot."""

from __future__ import annotations

import math

import pytest

from megamarl.config_sections import LoggerConfig, WandbConfig
from megamarl.runtime.metrics import MetricsLogger
from megamarl.runtime.plot import main, plot_run, run_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _close_figures():
    """``run_figures`` hands its figures to the caller: close what a test drew (pyplot keeps them)."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def write_synthetic_run(run_dir, *, num_steps: int = 40, eval_sets: bool = False) -> None:
    cfg = LoggerConfig(wandb=WandbConfig(mode="disabled"), progress=False)
    with MetricsLogger(run_dir, cfg, "synthetic", rank=0) as logger:
        for step in range(num_steps):
            wiggle = 0.05 * math.sin(step * 1.7)
            logger.log(
                step,
                {
                    "agent/planner/reward_mean": 0.2 + 0.5 * step / num_steps + wiggle,
                    "agent/executor/reward_mean": 0.1 + 0.3 * step / num_steps - wiggle,
                    "agent/planner/reward_std": 0.2,
                    "agent/executor/reward_std": 0.1,
                    "agent/planner/success": min(1.0, 0.1 + step / num_steps),
                    "agent/executor/success": 0.05 + 0.5 * step / num_steps,
                    "agent/executor/response_len": 120 - step,
                    "agent/planner/advantage_std": 0.9,
                    "policy/planner/grad_norm": 1.0 / (1 + step),
                    "policy/planner/entropy": 1.2 - 0.01 * step,
                    "policy/executor/grad_norm": 2.0 / (1 + step),
                    "timing_s/rollout": 30 + 3 * wiggle,
                    "timing_s/update": 12.0,
                    "timing_s/weight_sync": 2.5,
                    "timing_s/idle": 1.0,
                    "timing_s/step": 45.5 + 3 * wiggle,
                    "timing_s/planner/update": 6.0,
                    "perf/train_tokens_per_s": 900.0,
                    "perf/samples_per_s": 3.0,
                    "perf/max_memory_gib/planner": 2.5,
                    "perf/max_memory_gib/executor": 2.0,
                },
            )
            if step % 10 == 0 or step == num_steps - 1:
                p = step / num_steps
                if eval_sets:
                    results = {
                        "math/team_accuracy": 0.2 + 0.4 * p,
                        "code/team_accuracy": 0.1 + 0.2 * p,
                        "math/num_tasks": 128.0,
                        "code/num_tasks": 64.0,
                    }
                else:
                    results = {
                        "team_accuracy": 0.2 + 0.4 * p,
                        "avg@4": 0.2 + 0.4 * p,
                        "pass@4": 0.35 + 0.4 * p,
                        "num_tasks": 128.0,
                        "step": float(step),
                    }
                results.update({"agent/planner/success": 0.3 + 0.2 * p, "agent/executor/success": 0.1})
                logger.log_eval(step, results)


def _lines(ax) -> dict[str, tuple]:
    """legend label -> colour of the solid lines of an axis."""
    return {
        line.get_label().split(":")[0]: line.get_color()
        for line in ax.get_lines()
        if line.get_linestyle() == "-" and not line.get_label().startswith("_")
    }


def test_plot_run_writes_pngs(tmp_path):
    write_synthetic_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == [
        "rewards.png",
        "timing.png",
        "training.png",
        "throughput.png",
        "eval.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "plots" and path.read_bytes()[:8] == PNG_MAGIC


def test_every_axis_is_labelled_and_agents_keep_their_colours(tmp_path):
    write_synthetic_run(tmp_path)
    figures = run_figures(tmp_path)
    for name, fig in figures.items():
        for ax in fig.axes:
            if ax.axison:
                assert ax.get_ylabel(), f"{name}.png: an axis without a y label ({ax.get_title()})"
        assert any(ax.get_xlabel() == "step" for ax in fig.axes), name
    colors: dict[tuple[str, str], set] = {}  # (agent | policy, name) -> colours it was drawn in
    for fig in figures.values():
        for ax in fig.axes:
            title, ylabel = ax.get_title(), ax.get_ylabel()
            if title.startswith(("policy", "peak memory")) or ylabel == "policy success rate":
                kind = "policy"
            elif title.startswith("agent") or ylabel.startswith(("shaped reward", "own success")):
                kind = "agent"
            else:
                continue
            for label, color in _lines(ax).items():
                colors.setdefault((kind, label), set()).add(str(color))
    assert set(colors) == {(k, n) for k in ("agent", "policy") for n in ("planner", "executor")}
    assert all(len(c) == 1 for c in colors.values()), colors  # one colour per agent / policy everywhere
    # planner is both an agent and a policy here: they are told apart by colour
    assert colors[("agent", "planner")] != colors[("policy", "planner")]


def test_eval_draws_rates_only_with_base_model_references(tmp_path):
    write_synthetic_run(tmp_path)
    rates, agents = run_figures(tmp_path)["eval"].axes
    assert sorted(_lines(rates)) == ["pass@4", "team_accuracy"]  # no num_tasks, step or duplicate avg@4
    assert rates.get_ylabel() == "success rate" and rates.get_ylim() == (-0.03, 1.03)
    dashed = sorted(
        round(line.get_ydata()[0], 6) for line in rates.get_lines() if line.get_linestyle() == "--"
    )
    assert dashed == [0.2, 0.35]  # the step-0 (base model) values
    assert sorted(_lines(agents)) == ["executor", "planner"]


def test_eval_sets_are_separate_lines(tmp_path):
    write_synthetic_run(tmp_path, eval_sets=True)
    rates, _ = run_figures(tmp_path)["eval"].axes
    lines = _lines(rates)
    assert sorted(lines) == ["code/team_accuracy", "math/team_accuracy"]
    assert lines["code/team_accuracy"] != lines["math/team_accuracy"]


def test_timing_stacks_top_level_sections_of_old_and_new_names(tmp_path):
    cfg = LoggerConfig(wandb=WandbConfig(mode="disabled"), progress=False)
    with MetricsLogger(tmp_path, cfg, "r", rank=0) as logger:  # a run logged before timing_s/*
        logger.log(
            1,
            {
                "agent/a/reward_mean": 0.1,
                "timing/rollout_s": 3.0,
                "timing/update_s": 1.0,
                "timing/step_s": 4.5,
            },
        )
        logger.log(
            2,
            {
                "agent/a/reward_mean": 0.2,
                "timing/rollout_s": 2.0,
                "timing/update_s": 1.0,
                "timing/step_s": 3.5,
            },
        )
    ax = run_figures(tmp_path)["timing"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rollout", "update", "step (total)"]
    write_synthetic_run(tmp_path / "new", num_steps=3)
    ax = run_figures(tmp_path / "new")["timing"].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "rollout",
        "update",
        "weight_sync",
        "idle",
        "step (total)",
    ]  # not timing_s/planner/update


def test_eval_only_directory(tmp_path):
    import json

    (tmp_path / "eval.json").write_text(
        json.dumps(
            [
                {
                    "step": 0,
                    "time": 0,
                    "results": {"team_accuracy": 0.46875, "num_tasks": 128.0, "step": 0.0},
                },
                {
                    "step": 10,
                    "time": 1,
                    "results": {"team_accuracy": 0.59375, "num_tasks": 128.0, "step": 10.0},
                },
            ]
        )
    )
    assert [p.name for p in plot_run(tmp_path)] == ["eval.png"]


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


def test_missing_logs_names_the_dir(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl or eval.json"):
        plot_run(tmp_path)
