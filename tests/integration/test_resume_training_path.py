"""The whole training path of issue 24 in one ``scripts/train.py`` run on 4 ranks, killed and resumed.

Policy ``shared`` of signalling_tiny at TP=2 x DP=2 with megatron-core's distributed optimizer
(fp32 main params and Adam state sharded over the two DP ranks), ``recompute: full``, packed
micro-batches, PPO mini-batches of 32 of the 64 samples per step (two optimizer steps per update)
and a warmup learning-rate schedule. The run is SIGKILLed once step 3 is logged and resumed with
``trainer.resume=auto``; every per-step metric (rewards, losses, grad norms, learning rates) equals
an uninterrupted run's, and so do the final weights and optimizer state.
"""

from __future__ import annotations

import time

import pytest
from test_resume import RUN, _assert_same_final_checkpoint, _kill, _metrics, _stable, _start, _wait

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(1500),
]  # three runs of up to 400 s each, not the suite's 600 s default

PATH = (
    "policies.shared.tp=2",
    "policies.shared.distributed_optimizer=true",
    "policies.shared.recompute=full",
    "policies.shared.pack=true",
    "policies.shared.max_tokens_per_micro_batch=256",
    "policies.shared.mini_batch_size=32",
    "policies.shared.lr_schedule.warmup_steps=2",
)


def test_four_rank_training_path_killed_and_resumed(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    for d in (reference, resumed):
        d.mkdir()
    victim = _start(resumed, *PATH, num_ranks=4)
    metrics = resumed / RUN / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
        assert victim.poll() is None, (tmp_path / "resumed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 3"
        time.sleep(0.05)
    _kill(victim, resumed)
    assert (resumed / RUN / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    # the uninterrupted run after the kill (not beside it: 8 ranks on 2 cores would only be slower)
    _wait(_start(reference, *PATH, num_ranks=4), reference, timeout_s=400)
    _wait(_start(resumed, *PATH, "trainer.resume=auto", num_ranks=4), resumed, timeout_s=400)

    ref_metrics, res_metrics = _metrics(reference), _metrics(resumed)
    assert [r["step"] for r in res_metrics] == [1, 2, 3, 4]
    for ref, res in zip(ref_metrics, res_metrics, strict=True):
        assert _stable(res) == _stable(ref), f"step {ref['step']}"
    assert [r["policy/shared/optimizer_steps"] for r in ref_metrics] == [
        2.0
    ] * 4  # 64 samples (32 episodes x 2 agents) / 32
    assert [r["policy/shared/lr"] for r in ref_metrics] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])
    assert all(r["perf/padding_fraction/shared"] == 0.0 for r in ref_metrics)  # packed

    ref_run = _assert_same_final_checkpoint(reference, resumed, tmp_path)
    assert ref_run["lr_steps"] == {"shared": 4}
