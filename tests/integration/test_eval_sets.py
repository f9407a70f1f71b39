"""Held-out evaluation data end to end (issue #16): ``scripts/train.py`` trains on one JSONL file and
evaluates on two named sets (another file and the training file) at steps 0 and 2; eval.json holds both
sets at every evaluation. The same run has dynamic sampling with a bounded DAPO refill: a random tiny
model fails every task, so every group is flat and each step runs exactly max_refill_rounds extra rounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train as run_train  # tests/ helper

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
name: run
policies:
  shared: {model: tiny-random-llama, lr: 1.0e-4, micro_batch_size: 8, engine: {backend: hf, max_num_seqs: 16}}
agents:
  solver: {policy: shared, sampling: {temperature: 1.0, max_tokens: 4}}
env: {name: math, kwargs: {dataset_path: TRAIN, with_verifier: false}}
orchestra: {name: solve_verify, kwargs: {max_loops: 1}}
rollout: {num_tasks: 2, group_size: 2}
algorithm: {estimator: at_grpo, dynamic_sampling: true, max_refill_rounds: 1}
eval:
  num_tasks: 3
  sets:
    heldout: {kwargs: {dataset_path: HELDOUT, with_verifier: false}}
    train: {}
trainer: {total_steps: 2, seed: 0}
logger: {wandb: {mode: disabled}, progress: false}
"""


def _jsonl(path: Path, problems: list[tuple[str, int]]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in problems))
    return path


def test_train_on_a_evaluate_on_b_and_a(tmp_path):
    train = _jsonl(tmp_path / "a.jsonl", [(f"What is {i} + {i}?", 2 * i) for i in range(5)])
    heldout = _jsonl(tmp_path / "b.jsonl", [(f"What is {i} x 3?", 3 * i) for i in range(3)])
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("TRAIN", str(train)).replace("HELDOUT", str(heldout)))
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run_dir, _, output = run_train(
        config, tmp_path / "runs", nproc=1, timeout=600, env=env, overrides=("name=run",)
    )
    assert f"eval set heldout: env math {{'dataset_path': '{heldout}'" in output
    assert f"eval set train: env math {{'dataset_path': '{train}'" in output
    evals = json.loads((run_dir / "eval.json").read_text())
    assert [e["step"] for e in evals] == [0, 2]
    for entry in evals:
        results = entry["results"]
        for name in ("heldout", "train"):
            for metric in ("team_accuracy", "avg@1", "pass@1"):
                assert 0.0 <= results[f"{name}/{metric}"] <= 1.0, results
            assert results[f"{name}/num_tasks"] == 3.0
        assert "team_accuracy" not in results  # no unnamed default set when eval.sets is given
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # a random model fails everything: every group is flat, one refill round per step
        assert m["rollout/refill_rounds"] == 1.0 and m["rollout/informative_tasks"] == 0.0
        assert m["rollout/dropped_groups"] == 4.0  # 2 tasks x (solver turn 0) per round, 2 rounds
    assert metrics[-1]["rollout/total_refill_rounds"] == 2.0
