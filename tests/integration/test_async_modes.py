"""trainer.mode through the real entry script on the signalling game (tiny model): fully_async with
partial rollout on two ranks, per-sample staleness within trainer.max_staleness (from the histogram of
every trained sample's weight version), utilisation and drop metrics logged, and stale rows rejected by
the rollout/training mismatch correction (algorithm.mismatch, geometric level) with its metrics.

Each mode on one rank (sync, one_step_off, fully_async) is checked the same way, with the exact
staleness of one_step_off and TIS metrics off-policy, by tests/learning/test_signalling.py on its
100-step runs of the same config: three 3-step runs here would repeat those checks on a prefix of the
same runs (they were cut to save the suite's time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import check_staleness, train  # tests/ helper

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "signalling_tiny.yaml"


def train_signalling(
    mode: str,
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    timeout_s: float = 1800,
) -> tuple[list[dict], list[dict]]:
    """Run scripts/train.py on the signalling config in ``mode``; returns (metrics lines, eval entries)."""
    _, metrics, _ = train(
        CONFIG,
        run_dir.parent,
        nproc=nproc,
        timeout=timeout_s,
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        overrides=(f"trainer.mode={mode}", f"name={run_dir.name}", *overrides),
    )
    eval_file = run_dir / "eval.json"
    evals = json.loads(eval_file.read_text()) if eval_file.is_file() else []
    return metrics, evals


pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.distributed
def test_fully_async_partial_rollout_on_two_ranks(tmp_path):
    metrics, _ = train_signalling(
        "fully_async",
        tmp_path / "fa2",
        "trainer.total_steps=3",
        "eval.num_tasks=0",
        "trainer.max_staleness=2",
        "trainer.partial_rollout=true",
        *REJECT,
        nproc=2,
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    check_staleness(metrics, max_staleness=2)
    check_rejection(metrics)


# rows whose geometric-mean ratio (one-token replies: the token's) is outside [0.5, 2] are rejected, on
# top of the default token truncation; the batches after the first, sampled on the initial weights
# while the first update changed them, have such rows
REJECT = (
    "algorithm.mismatch.geometric.mode=reject",
    "algorithm.mismatch.geometric.lower=0.5",
    "algorithm.mismatch.geometric.upper=2.0",
)


def check_rejection(metrics: list[dict]) -> None:
    """Stale samples are measured and some rejected: the per-agent mismatch metrics in every line, the
    first batch on-policy (KL ~0), rows dropped later; with one-token replies a dropped token is a
    rejected row, so the two fractions are equal."""
    for agent in ("sender", "receiver"):
        kl = [m[f"agent/{agent}/mismatch_kl"] for m in metrics]
        masked = [m[f"agent/{agent}/mismatch_masked_frac"] for m in metrics]
        rejected = [m[f"agent/{agent}/mismatch_rejected_frac"] for m in metrics]
        print(f"{agent}: mismatch kl {kl}, masked {masked}, rejected {rejected}")
        assert kl[0] < 1e-4 and masked[0] == 0.0
        assert masked == rejected
    assert max(m[f"agent/{a}/mismatch_masked_frac"] for m in metrics for a in ("sender", "receiver")) > 0
