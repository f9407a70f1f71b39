"""The Slurm tier on two network-namespace nodes (issue 41, item 4, first part): slurmctld and one slurmd
on n0, a second slurmd on n1, each in its node's namespaces (``NodeName=n0,n1 NodeAddr=10.77.0.1,2``;
tests/slurm/slurm_cluster.py ``NodeSlurmCluster``, tests/nodes.py). A two-node step (``srun -N2``) runs
one task on each node, and ``sbatch --nodes 2`` gets both (about 5 s).

Then ``scripts/slurm/submit.sh`` as a user runs it on the first node (the login node), from the real
template, with ``-- --time=10 --signal=B:USR1@600``: the tiny signalling run at 2 ranks per node
(``cluster.num_nodes=2``, ranks 0-3), 2 steps. One job covers the paths the template must get right
(this tier replaced the one-node one; docs/cluster.md section 5):

* run 1 is preempted by a signal: the test sends USR1 to the batch shell (``scancel --batch
  --signal=USR1``, the way Slurm's warning arrives) as soon as the shell has started, before any rank
  exists. The held signal stops the ranks of both nodes after step 1, they save it and the template
  requeues the job;
* run 2 (the requeue) resumes at step 1, and nothing but Slurm's time-limit warning signals it (the
  warning moved to the whole time limit, so Slurm sends it at its first time-limit check of every run,
  0-30 s after the start, while the run starts up; 10 minutes leave a run slowed by a loaded machine
  room); it trains step 2, the last one, so the job completes (no second requeue), with one log for
  both runs (``--open-mode=append``). Slurm checks time limits every 30 s, and run 2 can start up and
  train its step faster than that: its env (tests/slurm/plugins/slurm_warning_wait.py, the signalling
  env otherwise) holds step 2's first episode until the rank has the signal, at most 2 minutes;
* its per-step metrics equal an uninterrupted 4-rank run's (forked ranks of this host beside the job,
  tests/train_runs.py: the launch does not change a seeded run). About 4-5 minutes.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper
from slurm_cluster import NodeSlurmCluster, ensure_installed
from train_runs import start, varies_between_runs  # tests/ helper

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
RUN = "signalling_tiny"
# env: the signalling env, waiting in a requeued run until Slurm's warning came (tests/slurm/plugins)
OVERRIDES = (
    "policies.shared.ranks=[0,1,2,3]",
    "cluster.num_nodes=2",
    "trainer.total_steps=2",
    "trainer.save_every=0",
    "rollout.num_tasks=4",
    "eval.num_tasks=0",
    "logger.progress=false",
    "env.name=signalling_slurm_warning_wait",
    "plugins=[slurm_warning_wait]",
    f"plugin_paths=[{ROOT / 'tests' / 'slurm' / 'plugins'}]",
)
JOB_TIMEOUT_S = 1200
DONE = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if reason := nodes_permitted() or ensure_installed():
        pytest.skip(reason)
    shared = tmp_path_factory.mktemp("shared")
    with cluster(2, shared) as nodes:
        slurm = NodeSlurmCluster(shared / "slurm", nodes)
        try:
            slurm.start()
            yield slurm
        finally:
            slurm.stop()


def test_each_node_runs_its_own_slurmd(slurm):
    nodes = slurm.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.splitlines()
    assert sorted(line.split() for line in nodes if line) == [["n0", "idle"], ["n1", "idle"]]
    for node in slurm.nodes:
        assert "slurmd" in node.ps()
    assert "slurmctld" in slurm.nodes[0].ps() and "slurmctld" not in slurm.nodes[1].ps()


def test_a_two_node_step_runs_a_task_on_each_node(slurm):
    done = slurm.run(
        "srun", "-N2", "--ntasks-per-node=1", "-l", "sh", "-c", "echo $(hostname) $SLURM_NODEID", timeout=120
    )
    assert sorted(done.stdout.splitlines()[:2]) == ["0: n0 0", "1: n1 1"], done.stdout + done.stderr


def test_a_two_node_batch_job(slurm, tmp_path_factory):
    out = slurm.root / "job.out"
    done = slurm.run(
        "sbatch",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--output={out}",
        "--wrap",
        "scontrol show hostnames $SLURM_JOB_NODELIST; srun hostname",
    )
    job = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    deadline = time.monotonic() + 120
    while slurm.job(job).get("JobState") != "COMPLETED":
        assert slurm.job(job).get("JobState") not in ("FAILED", "CANCELLED", "NODE_FAIL"), slurm.logs()
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(0.5)
    lines = out.read_text().split()
    assert lines[:2] == ["n0", "n1"] and sorted(lines[2:]) == ["n0", "n1"]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not varies_between_runs(k)} for row in rows]


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    out = slurm.root.parent / "job"  # on the shared filesystem
    out.mkdir()
    reference_out = tmp_path_factory.mktemp("reference")
    env = {
        **slurm.env,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(VENV_BIN.parent),
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("OMP_NUM_THREADS", None)
    done = slurm.run(
        "scripts/slurm/submit.sh",
        f"configs/{RUN}.yaml",
        *OVERRIDES,
        f"output_dir={out}",
        "--",
        f"--output={out}/%x-%j.out",
        f"--error={out}/%x-%j.out",
        "--time=10",
        "--signal=B:USR1@600",
        check=False,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    job_id = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    log = out / f"{RUN}-{job_id}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (log.is_file() and "megamarl: job" in log.read_text()):
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(0.2)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)  # before torchrun: no rank exists yet
    reference = start(
        ["--config", f"configs/{RUN}.yaml", *OVERRIDES, f"output_dir={reference_out}"],
        nproc=4,
        log=reference_out / "ranks.log",
        env={"PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"},
    )
    try:

        def finished(record: dict) -> bool:  # the first run's end before its requeue is not the end
            return record["JobState"] in DONE and (
                record.get("Restarts") != "0" or "requeueing job" not in log.read_text()
            )

        while not finished(record := slurm.job(job_id)):
            assert time.monotonic() < deadline, log.read_text()[-3000:] + slurm.logs()
            time.sleep(2)
        assert reference.wait(timeout=max(deadline - time.monotonic(), 1)) == 0
    finally:
        reference.kill()
    return {
        "record": record,
        "log": log.read_text(errors="replace"),
        "run_dir": out / RUN,
        "reference_dir": reference_out / RUN,
    }


def test_both_nodes_ranks_train_and_the_requeued_job_completes(job):
    record, log = job["record"], job["log"]
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log[
        -4000:
    ]
    assert record["NodeList"] == "n[0-1]" and "gres/gpu" not in record["TRES"], record  # from the CPU config
    first, _, second = log.partition("restart 1,")
    assert "restart 0," in first and second, log[-4000:]  # one log for both runs: appended, not truncated
    assert first.count("2 nodes x 2 ranks (0 GPUs,") == 1 and second.count("2 nodes x 2 ranks") == 1, log[
        -4000:
    ]
    assert "requeueing job" not in second and "megamarl: ranks exited 0" in second


def test_a_signal_before_the_ranks_start_is_held_and_stops_them_after_one_step(job):
    first = job["log"].partition("restart 1,")[0]
    assert first.index("megamarl: USR1") < first.index("config ok")  # before the check and torchrun
    assert "preempted (SIGUSR1): saved step 1;" in first
    assert "the ranks saved step 1 of 2 and stopped; requeueing job" in first


def test_the_requeued_run_resumes_exactly(job):
    second = job["log"].partition("restart 1,")[2]
    assert f"resumed from {job['run_dir'] / 'checkpoints' / 'step_000001'} at step 1" in second
    rows = _metrics(job["run_dir"])
    assert [r["step"] for r in rows] == [1, 2]
    assert rows == _metrics(job["reference_dir"])


def test_the_time_limit_warning_of_the_template_reaches_the_requeued_run(job):
    """Nothing but Slurm signals run 2: the template's warning, at --time=10 --signal=B:USR1@600 (sent at the
    first time-limit check, 0-30 s after the start; run 2's env holds step 2 until the signal came)."""
    record, second = job["record"], job["log"].partition("restart 1,")[2]
    assert "megamarl: USR1" in second, (
        "Slurm's time-limit warning did not come while run 2 was running "
        "(its env waits for it 2 minutes)\n" + second[-3000:]
    )
    assert second.index("megamarl: USR1") < second.index("step 2: "), second[-3000:]  # while it started up
    assert "preempted (SIGUSR1): saved step 2;" in second  # the last step: nothing left to requeue for
    assert (
        record["TimeLimit"] == "00:10:00" and record["JobState"] == "COMPLETED"
    )  # saved and stopped, not killed
