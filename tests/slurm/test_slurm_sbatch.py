"""scripts/slurm on a real one-node Slurm cluster (tests/slurm/slurm_cluster.py), through the documented
command (``scripts/slurm/submit.sh CONFIG [overrides] -- [sbatch options]``, docs/cluster.md section 5).

One job covers the four paths the template must get right, so that the tier costs two runs of
``torchrun scripts/train.py`` (the tiny signalling run at 2 CPU ranks, 2 steps: test_preemption's
overrides), submitted with ``-- --time=6 --signal=B:USR1@360``: the template's warning (USR1 to the
batch shell, its trap, forwarding and requeue), moved to the whole time limit so that Slurm sends it
at its first time-limit check of every run, 0-30 s after the start, while the run is still starting
up. (The template's 180 s with ``--time=3`` does the same, but a run slowed 6x by a loaded machine
then reached the hard limit before it finished: 6 minutes leave room.)

* run 1 is preempted by a signal: the test sends USR1 to the batch shell (``scancel --batch
  --signal=USR1``, the way Slurm's warning arrives) as soon as the shell has started, before any rank
  exists. The held signal stops the ranks after step 1, they save it and the template requeues the job;
* run 2 (the requeue) resumes at step 1, and nothing but Slurm's time-limit warning signals it while
  it starts up; it trains step 2, the last one, so the job completes (no second requeue), at 2 ranks,
  with one log for both runs (``--open-mode=append``). Slurm checks time limits every 30 s, and run 2
  can start up and train its step faster than that (CI saw it): its env
  (tests/slurm/plugins/slurm_warning_wait.py, the signalling env otherwise) holds step 2's first
  episode until the rank has the signal, at most 2 minutes.

The uninterrupted reference for the metrics runs beside the job on forked ranks (tests/train_runs.py:
the launch does not change a seeded run's metrics, and a third torchrun would cost ~70 CPU-s). Waits
poll files and ``scontrol`` every second or two.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, ensure_installed
from train_runs import start  # tests/ helper

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
RUN = "signalling_tiny"
# env: the signalling env, waiting in a requeued run until Slurm's warning came (tests/slurm/plugins)
OVERRIDES = ("policies.shared.ranks=[0,1]", "trainer.total_steps=2", "trainer.save_every=0", "rollout.num_tasks=4",
             "eval.num_tasks=0", "logger.progress=false", "env.name=signalling_slurm_warning_wait",
             "plugins=[slurm_warning_wait]", f"plugin_paths=[{ROOT / 'tests' / 'slurm' / 'plugins'}]")
JOB_TIMEOUT_S = 1500  # hang guard (the job takes about 2.5 min here, twice that beside the suite)
DONE = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(cluster: SlurmCluster, out: Path, *sbatch: str) -> str:
    """submit.sh as a user runs it, with the venv active (its bin first on PATH)."""
    env = {**cluster.env, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(VENV_BIN.parent),
           "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}
    env.pop("OMP_NUM_THREADS", None)  # the template's default (cores / ranks) is what a user gets
    done = subprocess.run(["scripts/slurm/submit.sh", "configs/signalling_tiny.yaml", *OVERRIDES, f"output_dir={out}",
                           "--", f"--output={out}/%x-%j.out", f"--error={out}/%x-%j.out", *sbatch],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return re.search(r"Submitted batch job (\d+)", done.stdout).group(1)


def _until(what: str, ready, cluster: SlurmCluster, deadline: float, every_s: float = 1.0):
    while not (value := ready()):
        assert time.monotonic() < deadline, f"{what}: not after {JOB_TIMEOUT_S} s\n{cluster.logs()}"
        time.sleep(every_s)
    return value


def _finished(cluster: SlurmCluster, job_id: str) -> dict | None:
    job = cluster.job(job_id)
    return job if job["JobState"] in DONE else None


def _metrics(run_dir: Path) -> list[dict]:
    volatile = ("time", "elapsed_s")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in volatile
             and not k.startswith(("timing/", "timing_s/", "weight_sync/", "perf/")) and not k.endswith(("_s", "_ratio"))}
            for row in rows]


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    """Runs the job and the reference; returns the final job record, the job's log, both run dirs."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    out, reference_out = tmp_path_factory.mktemp("job"), tmp_path_factory.mktemp("reference")
    job_id = _submit(cluster, out, "--time=6", "--signal=B:USR1@360")
    log = out / f"{RUN}-{job_id}.out"
    _until("the batch shell of the first run", lambda: log.is_file() and "megamarl: job" in log.read_text(),
           cluster, deadline, every_s=0.2)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)  # before torchrun: no rank exists yet
    reference = start(["--config", "configs/signalling_tiny.yaml", *OVERRIDES, f"output_dir={reference_out}"], nproc=2,
                      log=reference_out / "ranks.log", env={"PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"})
    try:
        record = _until(f"job {job_id}", lambda: _finished(cluster, job_id), cluster, deadline, every_s=2.0)
        assert reference.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, \
            (reference_out / "ranks.log").read_text()[-3000:]
    finally:
        reference.kill()
    return {"record": record, "log": log.read_text(errors="replace"), "run_dir": out / RUN,
            "reference_dir": reference_out / RUN}


def test_job_is_requeued_once_then_completes_on_two_cpu_ranks(job):
    record, log = job["record"], job["log"]
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    assert record["NumCPUs"] == "2" and "gres/gpu" not in record["TRES"], record  # from the CPU config
    first, _, second = log.partition("restart 1,")
    assert "restart 0," in first and second, log[-4000:]  # one log for both runs: appended, not truncated
    assert first.count("1 nodes x 2 ranks (0 GPUs, 2 CPUs per node)") == second.count("1 nodes x 2 ranks") == 1
    assert "requeueing job" not in second and "megamarl: ranks exited 0" in second


def test_signal_before_the_ranks_start_is_held_and_stops_them_after_one_step(job):
    first = job["log"].partition("restart 1,")[0]
    assert first.index("megamarl: USR1") < first.index("config ok")  # before the check and torchrun
    assert "preempted (SIGUSR1): saved step 1;" in first
    assert "the ranks saved step 1 of 2 and stopped; requeueing job" in first


def test_requeued_run_resumes_with_the_metrics_of_an_uninterrupted_run(job):
    second = job["log"].partition("restart 1,")[2]
    assert f"resumed from {job['run_dir'] / 'checkpoints' / 'step_000001'} at step 1" in second
    rows = _metrics(job["run_dir"])
    assert [r["step"] for r in rows] == [1, 2]
    assert rows == _metrics(job["reference_dir"])


def test_time_limit_warning_of_the_template_reaches_the_requeued_run(job):
    """Nothing but Slurm signals run 2: the template's warning, at --time=6 --signal=B:USR1@360 (sent at the
    first time-limit check, 0-30 s after the start; run 2's env holds step 2 until the signal came)."""
    record, second = job["record"], job["log"].partition("restart 1,")[2]
    assert "megamarl: USR1" in second, ("Slurm's time-limit warning did not come while run 2 was running "
                                        "(its env waits for it 2 minutes)\n" + second[-3000:])
    assert second.index("megamarl: USR1") < second.index("step 2: "), second[-3000:]  # while it started up
    assert "preempted (SIGUSR1): saved step 2;" in second  # the last step: nothing left to requeue for
    assert record["TimeLimit"] == "00:06:00" and record["JobState"] == "COMPLETED"  # saved and stopped, not killed
