"""Every trainer.mode through the real entry script on the signalling game (tiny model): a few
steps each, per-sample staleness within trainer.max_staleness (from the histogram of every trained
sample's weight version), utilisation and drop metrics logged; fully_async with partial rollout on
two ranks. The learning test in every mode is tests/learning/test_signalling.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "signalling_tiny.yaml"
MODES = ("sync", "one_step_off", "fully_async")


def train_signalling(
    mode: str, run_dir: Path, *overrides: str, nproc: int = 1, timeout_s: float = 1800,
) -> tuple[list[dict], list[dict]]:
    """Run scripts/train.py on the signalling config in ``mode``; returns (metrics lines, eval entries)."""
    args = [f"trainer.mode={mode}", f"output_dir={run_dir.parent}", f"name={run_dir.name}"]
    script = [str(ROOT / "scripts" / "train.py"), "--config", str(CONFIG), *args, *overrides]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    eval_file = run_dir / "eval.json"
    evals = json.loads(eval_file.read_text()) if eval_file.is_file() else []
    return metrics, evals


def check_staleness(metrics: list[dict], max_staleness: int) -> None:
    for m in metrics:
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in m.items() if k.startswith("async/staleness/")}
        assert hist and max(hist) <= max_staleness and m["async/staleness_max"] <= max_staleness, m
        assert sum(hist.values()) == m["rollout/num_samples"]  # every sample handed to the trainer
        for key in ("async/rollout_idle_ratio", "async/trainer_idle_ratio", "async/weight_sync_bubble_s",
                    "async/dropped_stale_groups", "rollout/total_dropped_stale_samples"):
            assert key in m, key


pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_with_bounded_staleness(tmp_path, mode):
    metrics, _ = train_signalling(mode, tmp_path / mode, "trainer.total_steps=3", "eval.num_tasks=0")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    check_staleness(metrics, max_staleness=1)
    lags = [m["async/staleness_mean"] for m in metrics]
    if mode == "sync":
        assert lags == [0.0, 0.0, 0.0]
    if mode == "one_step_off":
        assert lags == [0.0, 1.0, 1.0]  # the first batch is on-policy, then exactly one version off
    if mode != "sync":  # off-policy correction on (algorithm.tis_cap defaults to 2.0), with its metrics
        assert all("policy/shared/tis_weight_mean" in m and "policy/shared/tis_clip_frac" in m for m in metrics)


@pytest.mark.distributed
def test_fully_async_partial_rollout_on_two_ranks(tmp_path):
    metrics, _ = train_signalling(
        "fully_async", tmp_path / "fa2", "trainer.total_steps=3", "eval.num_tasks=0", "trainer.max_staleness=2",
        "trainer.partial_rollout=true", nproc=2,
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    check_staleness(metrics, max_staleness=2)
