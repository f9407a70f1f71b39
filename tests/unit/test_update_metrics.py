"""A step's update metrics do not depend on how its rows were cut into micro-batches: losses summed,
maxima maxed, other means weighted by each micro-batch's response tokens."""

import pytest

from megamarl.rl.update_metrics import RESPONSE_TOKENS, summarise

# four rows' per-token entropies (row: tokens) and their max ratio; the step's entropy is the token mean
ROWS = [(3, 1.0, 1.2), (1, 5.0, 3.0), (2, 2.0, 1.1), (4, 0.5, 1.5)]
TOKEN_MEAN = (3 * 1.0 + 1 * 5.0 + 2 * 2.0 + 4 * 0.5) / 10


def _micro_batch(rows):
    tokens = sum(n for n, _, _ in rows)
    return {
        "loss": 0.1 * len(rows),
        "entropy": sum(n * e for n, e, _ in rows) / tokens,
        "ratio_max": max(r for _, _, r in rows),
        RESPONSE_TOKENS: float(tokens),
    }


@pytest.mark.parametrize("cut", [[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0, 2], [1], [3]]])
def test_step_metrics_are_the_same_for_every_cut(cut):
    out = summarise([_micro_batch([ROWS[i] for i in group]) for group in cut], lr=1e-3)
    assert out["entropy"] == pytest.approx(TOKEN_MEAN, rel=1e-12)  # a mean of micro-batch means would differ
    assert out["ratio_max"] == 3.0 and out["loss"] == pytest.approx(0.4) and out["lr"] == 1e-3
    assert RESPONSE_TOKENS not in out


def test_micro_batches_without_response_tokens_fall_back_to_the_plain_mean():
    out = summarise([{"entropy": 1.0, RESPONSE_TOKENS: 0.0}, {"entropy": 3.0, RESPONSE_TOKENS: 0.0}])
    assert out["entropy"] == 2.0
