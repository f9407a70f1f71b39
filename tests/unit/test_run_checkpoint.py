"""Run-checkpoint bookkeeping in megamarl.runtime.checkpoint: which checkpoint ``trainer.resume`` picks
(incomplete ones never), the atomic commit, keep_last, and rewinding the run directory's logs."""

from __future__ import annotations

import json

import pytest

from megamarl.config_sections import LoggerConfig, WandbConfig
from megamarl.orchestration.context import derive_seed
from megamarl.runtime import checkpoint as run_ckpt
from megamarl.runtime.metrics import MetricsLogger, read_eval, read_metrics


def _checkpoint(run_dir, step, *, complete=True):
    path = run_ckpt.checkpoint_path(run_dir, step)
    path.mkdir(parents=True)
    if complete:
        (path / run_ckpt.COMPLETE).write_text("{}")
    return path


def test_resume_picks_the_latest_complete_checkpoint(tmp_path):
    assert run_ckpt.find_checkpoint("none", tmp_path) is None
    assert run_ckpt.find_checkpoint("auto", tmp_path) is None  # nothing yet: a fresh start
    _checkpoint(tmp_path, 2)
    latest = _checkpoint(tmp_path, 10)  # 10 > 2 numerically
    _checkpoint(tmp_path, 11, complete=False)  # killed before its marker
    run_ckpt.staging_path(run_ckpt.checkpoint_path(tmp_path, 12)).mkdir()  # killed while writing
    assert run_ckpt.find_checkpoint("auto", tmp_path) == latest
    assert run_ckpt.find_checkpoint(str(tmp_path), "elsewhere") == latest  # a run directory
    two = run_ckpt.checkpoint_path(tmp_path, 2)
    assert run_ckpt.find_checkpoint(str(two), "elsewhere") == two  # a checkpoint directory


@pytest.mark.parametrize(
    "bad, why",
    [
        ("missing", "does not exist"),
        ("checkpoints/step_000011", "no COMPLETE"),
        (".", "no complete checkpoint"),
    ],
)
def test_resume_from_a_bad_path_names_the_key(tmp_path, bad, why):
    _checkpoint(tmp_path, 11, complete=False)
    with pytest.raises(ValueError, match=f"trainer.resume=.*{why}"):
        run_ckpt.find_checkpoint(str(tmp_path / bad), tmp_path)


def test_commit_is_a_rename_and_replaces_the_same_step(tmp_path):
    final = run_ckpt.checkpoint_path(tmp_path, 3)
    for version in (1, 2):
        staging = run_ckpt.staging_path(final)
        (staging / "policies").mkdir(parents=True)
        (staging / "policies" / "v").write_text(str(version))
        run_ckpt.commit(staging, final, {"step": 3, "version": version})
        assert not staging.exists() and (final / run_ckpt.COMPLETE).is_file()
        assert (final / "policies" / "v").read_text() == str(version)
        assert run_ckpt.load_trainer_state(final)["version"] == version
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_000003"]


def test_a_checkpoint_carries_its_steps_metrics_line(tmp_path):
    """``commit(..., line)`` writes the step's metrics line (in the manifest, like every file); a
    checkpoint without one (older, or committed without) reads as {}. The logger's ``last_step`` says
    whether the resumed run must log it."""
    final = run_ckpt.checkpoint_path(tmp_path, 2)
    staging = run_ckpt.staging_path(final)
    staging.mkdir(parents=True)
    run_ckpt.commit(staging, final, {"step": 2}, {"loss": 0.5, "timing_s/step": 1.25})
    assert run_ckpt.load_metrics_line(final) == {"loss": 0.5, "timing_s/step": 1.25}
    manifest = json.loads((final / run_ckpt.COMPLETE).read_text())
    assert run_ckpt.METRICS_LINE in manifest["files"]
    older = _checkpoint(tmp_path, 1)
    assert run_ckpt.load_metrics_line(older) == {}
    logger = MetricsLogger(tmp_path, LoggerConfig(wandb=WandbConfig(mode="disabled")), "run")
    assert logger.last_step() == 0
    logger.log(1, {"loss": 1.0})
    assert logger.last_step() == 1
    logger.close()


def test_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 5, complete=False)
    run_ckpt.prune(tmp_path, keep_last=0)
    assert len(run_ckpt.list_checkpoints(tmp_path)) == 4
    run_ckpt.prune(tmp_path, keep_last=2)
    assert [run_ckpt.checkpoint_step(p) for p in run_ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert run_ckpt.checkpoint_path(tmp_path, 5).is_dir()  # incomplete: not counted, not deleted


def test_rewind_cuts_logs_after_the_step_while_the_logger_appends(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig(wandb=WandbConfig(mode="disabled")), "run")
    for step in (1, 2, 3):
        logger.log_trained_groups(step, {"p": {"key": ["task"], "groups": [[f"t@{step - 1}", 4]]}})
        logger.log(step, {"loss": float(step)})
        logger.log_eval(step, {"acc": 0.1 * step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a line torn by the crash
    _checkpoint(tmp_path, 2)
    later = _checkpoint(tmp_path, 3)

    run_ckpt.rewind_run_dir(tmp_path, 2)  # resume from step 2 with the logger already open
    logger.log_trained_groups(3, {"p": {"key": ["task"], "groups": [["t@2", 4]]}})
    logger.log(3, {"loss": 30.0})
    logger.close()

    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    groups = [json.loads(line) for line in (tmp_path / "trained_groups.jsonl").read_text().splitlines()]
    assert [(g["step"], g["policies"]["p"]["groups"]) for g in groups] == [
        (1, [["t@0", 4]]),
        (2, [["t@1", 4]]),
        (3, [["t@2", 4]]),
    ]
    assert [e["step"] for e in read_eval(tmp_path)] == [1, 2]
    assert not later.exists() and later.with_name(later.name + ".discarded").is_dir()
    assert [run_ckpt.checkpoint_step(p) for p in run_ckpt.list_checkpoints(tmp_path)] == [2]
    json.loads((tmp_path / "eval.json").read_text())  # still valid JSON


def test_rng_round_trip(tmp_path):
    import random

    import numpy as np
    import torch

    run_ckpt.save_rng(tmp_path, 3)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.random(), np.random.rand(), torch.rand(())
    assert run_ckpt.load_rng(tmp_path, 3) and not run_ckpt.load_rng(tmp_path, 4)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_derived_sampling_seeds_are_stable_and_distinct():
    assert derive_seed(0, "signal-7-0/1", "sender", 0) == 693171824678856772  # the same in every process
    parts = [(s, e, a, t) for s in (0, 1) for e in ("t/0", "t/1") for a in ("x", "y") for t in (0, 1)]
    seeds = {derive_seed(*p) for p in parts}
    assert len(seeds) == 16 and all(0 <= s < 2**62 for s in seeds)
