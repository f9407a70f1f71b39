"""The Slurm tier on two network-namespace nodes (issue 41, item 4, first part): slurmctld and one slurmd
on n0, a second slurmd on n1, each in its node's namespaces (``NodeName=n0,n1 NodeAddr=10.77.0.1,2``;
tests/slurm/slurm_cluster.py ``NodeSlurmCluster``, tests/nodes.py). A two-node step (``srun -N2``) runs
one task on each node, and ``sbatch --nodes 2`` gets both. What is not here yet: scripts/slurm/submit.sh
training on both nodes and a requeue across them (docs/cluster.md, section 5). About 15 s."""

from __future__ import annotations

import re
import time

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper
from slurm_cluster import NodeSlurmCluster, ensure_installed

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.timeout(300)]


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
    done = slurm.run("srun", "-N2", "--ntasks-per-node=1", "-l", "sh", "-c", "echo $(hostname) $SLURM_NODEID",
                     timeout=120)
    assert sorted(done.stdout.splitlines()[:2]) == ["0: n0 0", "1: n1 1"], done.stdout + done.stderr


def test_a_two_node_batch_job(slurm, tmp_path_factory):
    out = slurm.root / "job.out"
    done = slurm.run("sbatch", "--nodes=2", "--ntasks-per-node=1", f"--output={out}", "--wrap",
                     "scontrol show hostnames $SLURM_JOB_NODELIST; srun hostname")
    job = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    deadline = time.monotonic() + 120
    while slurm.job(job).get("JobState") != "COMPLETED":
        assert slurm.job(job).get("JobState") not in ("FAILED", "CANCELLED", "NODE_FAIL"), slurm.logs()
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(0.5)
    lines = out.read_text().split()
    assert lines[:2] == ["n0", "n1"] and sorted(lines[2:]) == ["n0", "n1"]
