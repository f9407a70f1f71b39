"""``scripts/train.py`` under torchrun, for the integration tests that check a run from its outputs, and
checks shared by several of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(config: Path, out: Path, *, nproc: int, port: int, timeout: int,
          env: dict[str, str] | None = None) -> tuple[Path, list[dict], str]:
    """Run ``config`` on ``nproc`` local ranks with its outputs under ``out``. Returns the run
    directory (``out/<config stem>``), its metrics rows and the launcher's output; a failed run
    raises with the tails of that output and of every engine server's log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           str(ROOT / "scripts" / "train.py"), "--config", str(config), f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "CI": "true", **(env or {})})
    run_dir = out / config.stem
    if proc.returncode != 0:
        logs = sorted((run_dir / "engine_logs").glob("*.log")) if run_dir.exists() else []
        tails = "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
        raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}{tails}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows, proc.stdout + proc.stderr


def check_staleness(metrics: list[dict], max_staleness: int) -> None:
    """Every step's per-sample staleness (the histogram of every trained sample's weight version) is
    within ``max_staleness`` and covers every sample; the async metrics are logged."""
    for m in metrics:
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in m.items() if k.startswith("async/staleness/")}
        assert hist and max(hist) <= max_staleness and m["async/staleness_max"] <= max_staleness, m
        assert sum(hist.values()) == m["rollout/num_samples"]  # every sample handed to the trainer
        for key in ("async/rollout_idle_ratio", "async/trainer_idle_ratio", "async/weight_sync_bubble_s",
                    "async/dropped_stale_groups", "rollout/total_dropped_stale_samples"):
            assert key in m, key
