"""One engine server's node unreachable in the middle of a ``scripts/train.py`` run (issue 41, item 5).

Two namespace nodes (tests/nodes.py). The policy has two replicas, external SGLang servers
(``engine.server_urls``; ``tests/fake_sglang``: SGLang's command line and HTTP protocol, transformers
behind it, a real gloo receiver), one on n0 and one on n1; the run is ``torchrun`` with its one rank on
n0, so n1 holds no rank: pulling n1's cable cuts a replica off, never the training world (an
``engine.ranks`` server on n1 would be a rank of the world, and the lost-node watch would stop the run).
Once step 1's metrics row is written (step 2's rollout starts), n1's link goes down; once two more rows
are written it comes back. From the run's own outputs (metrics.jsonl, its log, the servers' logs):

* the pool declares n1's replica dead within ``engine.stall_s + engine.health_patience_s`` (+ one
  5 s probe), the requests waiting on it are retried on n0's (``engine/<p>/failovers``);
* the steps of the outage complete on n0's replica alone, no episode fails;
* after the link returns the replica rejoins (``engine/<p>/restarts`` = 1), takes no request while its
  weights are stale, and the next push reaches it (a re-sync of it alone at a step's start, or the
  step's push into every live replica, whichever comes first): the trained weights travel over a new
  gloo group to n1 (its log: the group's rendezvous on n0's address, the tensors, the version stamp),
  verified against transformers (``engine.verify_sync``); then it serves again at the pool's version;
* the run finishes every step and exits 0.

The measured timeline is printed and written to ``<shared>/timeline.json``. About 1.5 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper

from megamarl.runtime.metrics import read_metrics

pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PORT, RDZV_PORT = 30100, 29420
STEPS = 6
STALL_S, PATIENCE_S, PROBE_S = 3, 5, 5  # engine.stall_s, engine.health_patience_s; JSONClient.answers' probe
DEAD_BOUND_S = STALL_S + max(PATIENCE_S, PROBE_S) + 5  # + the pool's 1 s poll and a loaded machine's slack
EPISODES = 16
CONFIG = """
name: link
policies:
  shared:
    model: tiny-random-llama
    ranks: [0]
    lr: 1.0e-3
    seq_len: 128
    dtype: fp32
    engine: {{backend: sglang, num_replicas: 2, server_urls: {urls}, dtype: fp32, bucket_mb: 1,
             verify_sync: true, stall_s: {stall}, health_patience_s: {patience}}}
agents:
  sender: {{policy: shared, sampling: {{temperature: 1.0, max_tokens: 16}}}}
  receiver: {{policy: shared, sampling: {{temperature: 1.0, max_tokens: 16}}}}
env: {{name: signalling, kwargs: {{terse: true, num_symbols: 2, num_digits: 2}}}}
orchestra: {{name: sequential}}
rollout: {{num_tasks: 4, group_size: 4, max_concurrency: 4}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: 0}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false, plots: false}}
"""


class ServerLog:
    """An SGLang server's ``[fake-sglang] {json}`` call records, each with the time it was read."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.calls = proc, []
        for line in proc.stdout:  # up to the start-up line
            if "[fake-sglang] serving" in line:
                break
        else:
            raise RuntimeError(f"the SGLang server exited {proc.wait()} before serving")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("[fake-sglang] {"):
                self.calls.append((time.time(), json.loads(line.split(" ", 1)[1])))

    def after(self, t: float, path: str | None = None) -> list[tuple[float, dict]]:
        return [(at, c) for at, c in self.calls if at > t and (path is None or c["path"] == path)]


def _rows(run_dir: Path) -> list[dict]:
    """The rows written so far: polled while the run appends, so a half-written last line is skipped
    (``read_metrics`` does that)."""
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    from megamarl.models.packaged import resolve_model_path

    shared = tmp_path_factory.mktemp("link")
    model = str(resolve_model_path("tiny-random-llama"))
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "fake_sglang"), str(ROOT)) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }
    timeline: dict = {}
    with cluster(2, shared) as nodes:
        n0, n1 = nodes
        servers = [
            ServerLog(
                node.popen(
                    [
                        PY,
                        "-m",
                        "sglang.launch_server",
                        "--model-path",
                        model,
                        "--host",
                        node.addr,
                        "--port",
                        str(PORT),
                        "--dtype",
                        "float32",
                        "--random-seed",
                        str(node.index),
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            for node in nodes
        ]
        urls = [f"http://{node.addr}:{PORT}" for node in nodes]
        config = shared / "link.yaml"
        config.write_text(
            CONFIG.format(urls=json.dumps(urls), stall=STALL_S, patience=PATIENCE_S, steps=STEPS)
        )
        log_path, run_dir = shared / "torchrun-n0.log", shared / "link"
        with open(log_path, "w") as log:
            proc = n0.popen(
                [
                    TORCHRUN,
                    "--nnodes",
                    "1",
                    "--nproc_per_node",
                    "1",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{n0.addr}:{RDZV_PORT}",
                    "--rdzv-id",
                    "link",
                    "--max-restarts",
                    "0",
                    "scripts/train.py",
                    "--config",
                    str(config),
                    f"output_dir={shared}",
                ],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        start = time.time()

        def wait(what: str, done) -> float:
            deadline = time.monotonic() + 600
            while not done():
                assert proc.poll() is None, (
                    f"the run exited {proc.returncode} waiting for {what}:\n"
                    + log_path.read_text(errors="replace")[-4000:]
                )
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.05)
            return time.time()

        wait("step 1's metrics row", lambda: len(_rows(run_dir)) >= 1)
        n1.link_down()
        timeline["link_down"] = time.time()
        timeline["rows_at_link_down"] = len(_rows(run_dir))
        timeline["dead_declared"] = wait(
            "the dead replica's line", lambda: "engine replica 1 is unreachable" in log_path.read_text()
        )
        down_until = timeline["rows_at_link_down"] + 2
        wait(f"step {down_until}'s metrics row", lambda: len(_rows(run_dir)) >= down_until)
        n1.link_up()
        timeline["link_up"] = time.time()
        timeline["rows_at_link_up"] = len(_rows(run_dir))
        try:
            timeline["exit_code"] = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                n0.kill_all()
        timeline["end"] = time.time()
        output = log_path.read_text(errors="replace")
    rows = _rows(run_dir)
    n1_log = servers[1]
    up = timeline["link_up"]
    rejoined = n1_log.after(up)
    timeline["rejoined"] = rejoined[0][0] if rejoined else None  # the first call after the link returned
    groups = n1_log.after(up, "/init_weights_update_group")
    timeline["resync_push"] = groups[0][0] if groups else None  # the push's group forms
    stamps = n1_log.after(up, "/update_weight_version")
    timeline["resync_stamped"] = stamps[0][0] if stamps else None
    served = [at for at, _ in n1_log.after(timeline["resync_stamped"] or up, "/generate")]
    timeline["served_again"] = served[0] if served else None
    timeline["wall_s"] = round(timeline["end"] - start, 1)
    relative = {
        k: (round(v - start, 1) if isinstance(v, float) and k not in ("wall_s",) else v)
        for k, v in timeline.items()
    }
    (shared / "timeline.json").write_text(json.dumps(relative, indent=1))
    print("link-down timeline (s after the launch):", json.dumps(relative), file=sys.stderr)
    return LinkRun(timeline, rows, output, servers, nodes)


class LinkRun:
    def __init__(self, timeline, rows, output, servers, nodes) -> None:
        self.timeline, self.rows, self.output, self.servers, self.nodes = (
            timeline,
            rows,
            output,
            servers,
            nodes,
        )

    def during_outage(self) -> list[dict]:
        t = self.timeline
        return self.rows[t["rows_at_link_down"] : t["rows_at_link_up"]]


KEY = "engine/shared"


def test_the_run_finishes_every_step_and_exits_0(run):
    assert run.timeline["exit_code"] == 0, run.output[-4000:]
    assert [r["step"] for r in run.rows] == list(range(1, STEPS + 1))
    for row in run.rows:
        assert row["rollout/num_episodes"] == EPISODES and row["rollout/num_failed"] == 0, row
    assert run.rows[0][f"{KEY}/live_replicas"] == 2
    assert run.rows[0][f"{KEY}/replica1/requests"] > 0  # n1's replica served before its link went down


def test_the_unreachable_replica_is_declared_dead_within_the_bound(run):
    t = run.timeline
    assert t["rows_at_link_down"] == 1
    assert t["dead_declared"] - t["link_down"] < DEAD_BOUND_S, t
    assert [line for line in run.output.splitlines() if "engine replica 1 is unreachable" in line]


def test_the_steps_of_the_outage_complete_on_the_other_replica(run):
    outage = run.during_outage()
    assert len(outage) == 2, run.timeline
    first, second = outage
    assert first[f"{KEY}/failovers"] >= 1  # the requests waiting on n1 were retried on n0
    assert first[f"{KEY}/restarts"] == 0  # dead, not rebuilt: n1 does not answer
    for row in outage:
        assert row[f"{KEY}/live_replicas"] == 1, row
    # the step that started with the link down: every request went to n0
    assert second[f"{KEY}/replica1/requests"] == first[f"{KEY}/replica1/requests"]
    assert second[f"{KEY}/replica0/requests"] - first[f"{KEY}/replica0/requests"] >= EPISODES


def test_it_rejoins_gets_a_real_push_and_serves_again(run):
    n0, _ = run.nodes
    after = run.rows[run.timeline["rows_at_link_up"] :]
    # the first push after the rebuild reaches it: a re-sync of it alone at a step's start, or the step's
    # push into every live replica; verified against transformers on the pushed tensors either way
    pushed = [
        r
        for r in after
        if r.get("weight_sync/shared/resync/replicas") == 1 or r.get("weight_sync/shared/replicas") == 2
    ]
    assert pushed, after
    row = pushed[0]
    resync = "weight_sync/shared/resync/replicas" in row
    prefix = "weight_sync/shared/resync" if resync else "weight_sync/shared"
    assert row[f"{prefix}/bytes"] > 0
    assert row[f"{prefix}/verified_replicas"] == row[f"{prefix}/replicas"]
    last = run.rows[-1]
    assert last[f"{KEY}/restarts"] == 1 and last[f"{KEY}/live_replicas"] == 2
    assert last[f"{KEY}/replica1/weight_version"] == last[f"{KEY}/replica0/weight_version"] > 0
    assert last[f"{KEY}/replica1/requests"] > run.during_outage()[-1][f"{KEY}/replica1/requests"]
    # n1's own log: after the link returned, a new update group with its rendezvous on n0's address,
    # the tensors broadcast over it, the version stamped (n0's server got the same); no request before it
    up = run.timeline["link_up"]
    n1_log, n0_log = run.servers[1], run.servers[0]
    (_, group), *_ = n1_log.after(up, "/init_weights_update_group")
    assert group["body"]["master_address"] == n0.addr and group["body"]["backend"] == "gloo"
    assert sum(c["num_tensors"] for _, c in n1_log.after(up, "/update_weights_from_distributed")) > 0
    stamped_at, stamp = n1_log.after(up, "/update_weight_version")[0]
    generated = [at for at, _ in n1_log.after(up, "/generate")]
    assert generated and min(generated) > stamped_at  # stale until the push: no traffic before it
    stamps = [c["body"]["new_version"] for _, c in n1_log.after(up, "/update_weight_version")]
    stamps0 = [c["body"]["new_version"] for _, c in n0_log.calls if c["path"] == "/update_weight_version"]
    assert stamp["body"]["new_version"] in stamps0 and stamps[-1] == stamps0[-1]
