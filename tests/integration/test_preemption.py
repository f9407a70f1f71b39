"""Preemption: SIGTERM (or SIGUSR1) in the middle of a run -> the step finishes, a checkpoint is
saved, the process exits 0; ``trainer.resume=auto`` continues and the metrics of every step equal
an uninterrupted run's (tiny signalling, 1 rank, ``scripts/train.py`` through ``train_runs.start``; the
signal goes to the rank's process group, as a scheduler signals a job's processes).

Both signals compare with one uninterrupted reference run (a module fixture: the reference does not
depend on the signal), started beside the first victim. Deadlines are hang guards, sized for a busy
machine (the suite runs on two xdist workers)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from train_runs import Ranks, start, varies_between_runs  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN = "signalling_tiny"
RUN_TIMEOUT_S = 600
OVERRIDES = (
    "trainer.total_steps=4",
    "trainer.save_every=0",
    "rollout.num_tasks=4",
    "eval.num_tasks=0",
    "logger.progress=false",
)


def _start(output_dir: Path, *extra: str) -> Ranks:
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    argv = ["--config", "configs/signalling_tiny.yaml", *OVERRIDES, f"output_dir={output_dir}", *extra]
    return start(argv, nproc=1, log=output_dir.parent / f"{output_dir.name}-{len(extra)}.log", env=env)


def _log(output_dir: Path, num_extra: int) -> str:
    return (output_dir.parent / f"{output_dir.name}-{num_extra}.log").read_text()


def _metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / RUN / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not varies_between_runs(k)} for line in lines]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (started, not awaited: it runs beside the first test's victim)."""
    reference = tmp_path_factory.mktemp("preemption") / "reference"
    reference.mkdir()
    proc = _start(reference)
    yield reference, proc
    if proc.poll() is None:
        proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_exits_zero_and_resumes_exactly(tmp_path, reference, sig):
    reference, ref_proc = reference
    victim_dir = tmp_path / "preempted"
    victim_dir.mkdir()
    victim = _start(victim_dir)
    metrics = victim_dir / RUN / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (metrics.is_file() and '"step": 1,' in metrics.read_text()):
        assert victim.poll() is None, _log(victim_dir, 0)[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 1"
        time.sleep(0.02)
    victim.send_signal(sig)  # somewhere in step 2 (or right at step 1's end)
    assert victim.wait(timeout=RUN_TIMEOUT_S) == 0, _log(victim_dir, 0)[-3000:]
    checkpoints = sorted(p.parent.name for p in (victim_dir / RUN / "checkpoints").glob("step_*/COMPLETE"))
    assert len(checkpoints) == 1 and checkpoints[0] in ("step_000001", "step_000002", "step_000003"), (
        checkpoints
    )
    saved_step = int(checkpoints[0][-1])
    assert f"preempted ({sig.name}): saved step {saved_step}" in _log(victim_dir, 0)
    assert [r["step"] for r in _metrics(victim_dir)] == list(range(1, saved_step + 1))
    resumed = _start(victim_dir, "trainer.resume=auto")
    assert resumed.wait(timeout=RUN_TIMEOUT_S) == 0, _log(victim_dir, 1)[-3000:]
    assert ref_proc.wait(timeout=RUN_TIMEOUT_S) == 0, _log(reference, 0)[-3000:]
    assert f"resumed from {victim_dir / RUN / 'checkpoints' / checkpoints[0]} at step {saved_step}" in _log(
        victim_dir, 1
    )
    ref_metrics, res_metrics = _metrics(reference), _metrics(victim_dir)
    assert [r["step"] for r in res_metrics] == [1, 2, 3, 4]
    assert res_metrics == ref_metrics
    assert any(r["policy/shared/grad_norm"] > 0 for r in ref_metrics)
