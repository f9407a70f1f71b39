"""``rollout.env_workers`` through ``scripts/train.py`` (configs/slow_judge.yaml: the signalling game
with a blocking judge on every step, ``Env.remote_step``): the judges run in process workers or Ray
actors, and a judge slower than ``rollout.env_timeout_s`` fails its episode (counted), not the run.

Checked from the run directory only: the step's ``env_workers/*`` counters equal what the episodes
imply (every step of a finished episode went through a worker; each timed-out step is one failed
episode). That the judges of concurrent episodes overlap is a timing, measured by
``scripts/bench_env_workers.py`` (docs/performance.md), not asserted here. Last, process workers of a
driver killed with SIGKILL exit by themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "slow_judge.yaml"
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
NUM_TASKS, GROUP_SIZE = 4, 2
JUDGE_S = (0.05, 0.05, 20.0)  # drawn per task: with seed 0, one task of four has the 20 s judge
# EnvMaker("slow_judge", judge_s=list(JUDGE_S)).tasks(NUM_TASKS, seed=0): step 1's tasks (the driver's chunk
# 0, seed trainer.seed * 1_000_003). Written out: importing the plugin env here would register it in this
# test process, and the config reference (test_config_reference) lists only the built-in envs.
NUM_SLOW_TASKS = 1
TIMEOUT_S = 5.0  # a hang guard for the fast judges on a loaded machine, far below the slow one


def _run(out: Path, *overrides: str) -> tuple[dict, str]:
    _, rows, output = train(
        CONFIG,
        out,
        nproc=1,
        timeout=600,
        env=ENV,
        overrides=(
            "trainer.total_steps=1",
            f"rollout.num_tasks={NUM_TASKS}",
            f"rollout.group_size={GROUP_SIZE}",
            *overrides,
        ),
    )
    assert len(rows) == 1
    return rows[0], output


@pytest.fixture(scope="module")
def process_run(tmp_path_factory) -> tuple[dict, str]:
    return _run(
        tmp_path_factory.mktemp("env_workers"),
        "rollout.env_workers.backend=process",
        "rollout.env_workers.num_workers=2",
        f"env.kwargs.judge_s=[{','.join(map(str, JUDGE_S))}]",
        f"rollout.env_timeout_s={TIMEOUT_S}",
    )


def test_process_workers_run_every_judged_step(process_run):
    metrics, output = process_run
    assert "env steps of slow_judge: in 2 process workers (rollout.env_workers)" in output
    num_episodes = NUM_TASKS * GROUP_SIZE
    num_failed = int(metrics["rollout/num_failed"])
    # a finished episode made two judged steps (sender, receiver); a timed-out one its first only
    assert metrics["env_workers/calls"] == 2 * (num_episodes - num_failed) + num_failed
    assert metrics["rollout/num_samples"] == 2 * (num_episodes - num_failed)


def test_worker_timeout_is_a_counted_failed_episode(process_run):
    metrics, _ = process_run
    expected = NUM_SLOW_TASKS * GROUP_SIZE
    assert metrics["env_workers/timeouts"] == metrics["rollout/num_failed"] == expected
    assert metrics["rollout/total_failed_episodes"] == expected
    assert metrics["env_workers/crashes"] == metrics["env_workers/errors"] == 0


@pytest.mark.slow  # a local Ray cluster starts and stops in the run (~10 CPU-s)
def test_ray_actors_in_a_local_cluster_started_by_the_run(tmp_path):
    pytest.importorskip("ray")
    metrics, output = _run(
        tmp_path,
        "rollout.env_workers.backend=ray",
        "rollout.env_workers.num_workers=1",
        "env.kwargs.judge_s=[0.05]",
    )
    assert "env steps of slow_judge: in 1 ray workers (rollout.env_workers)" in output
    assert metrics["env_workers/calls"] == 2 * NUM_TASKS * GROUP_SIZE and metrics["rollout/num_failed"] == 0


KILLED_DRIVER = """
import time
from megamarl.orchestration import make_workers
if __name__ == "__main__":
    workers = make_workers(backend="process", num_workers=2)
    print(*(p.pid for slot in workers._slots for p in slot._processes.values()), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its reaper has not looked yet)


def test_process_workers_exit_with_a_killed_driver(tmp_path):
    """A driver killed without ``close`` (SIGKILL: no atexit, no finally) leaves no worker behind."""
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(map(_alive, pids))
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), f"env workers {pids} outlived their killed driver"
