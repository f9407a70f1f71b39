"""Disk full while checkpointing: the write fails (the writer is patched to raise ENOSPC, once
while the policy shards are written, once on the COMPLETE marker); every rank stops with an error
that names the previous checkpoint, which stays complete and resumes."""

import errno
from pathlib import Path

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _run(rank, output_dir, where):
    from megamarl.cli.configure import load_config
    from megamarl.errors import CheckpointWriteError
    from megamarl.models import dist_checkpoint
    from megamarl.trainer import Trainer

    overrides = [
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "rollout.num_tasks=2",
        "rollout.group_size=4",
        "eval.num_tasks=0",
        f"output_dir={output_dir}",
    ]
    trainer = Trainer(load_config(ROOT / "configs/signalling_tiny.yaml", overrides))
    real = {"shards": dist_checkpoint.save_checkpoint, "marker": Path.write_text}
    calls = {"n": 0}

    def failing_on_step_2(*args, **kwargs):
        if trainer.step == 2:  # step 1 saves normally
            calls["n"] += 1
            _disk_full()
        return real[where](*args, **kwargs)

    if where == "shards":
        dist_checkpoint.save_checkpoint = failing_on_step_2
    else:
        Path.write_text = failing_on_step_2
    try:
        trainer.fit()
        error = ""
    except CheckpointWriteError as exc:
        error = str(exc)
    finally:
        dist_checkpoint.save_checkpoint, Path.write_text = real["shards"], real["marker"]
    left = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    resumed = Trainer(load_config(ROOT / "configs/signalling_tiny.yaml", [*overrides, "trainer.resume=auto"]))
    return error, calls["n"], left, resumed.step


@pytest.mark.parametrize("where", ["shards", "marker"])
def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, where):
    ((error, calls, left, resumed_step),) = run_ranks(_run, 1, str(tmp_path), where, timeout_s=300)
    previous = tmp_path / "signalling_tiny" / "checkpoints" / "step_000001"
    assert calls == 1 and left == ["step_000001"], (left, error)  # no step_000002(.partial) left
    assert (
        "writing checkpoint" in error
        and "step_000002 failed (rank 0: OSError: [Errno 28] No space left" in error
    )
    assert f"the previous checkpoint {previous} is complete and loadable" in error
    assert resumed_step == 1
