"""Rollout/training mismatch correction (megamarl/rl/mismatch.py) against hand-computed numbers: every
level (token, sequence, geometric) in every mode (truncate, mask, reject), levels combined, the
mismatch metrics (k3 KL, PPL ratio, masked and rejected fractions) per agent, and the config keys
(``algorithm.mismatch``, ``policies.<p>.algorithm.mismatch``, the retired ``algorithm.tis_cap``).

The batch: two rows, rollout log-prob -1 everywhere, training log-prob -1 + d with
  row 0 (solver):   d = ln 2, ln 0.5, ln 4  -> token ratios 2, 0.5, 4; sequence 4; geometric 4^(1/3)
  row 1 (verifier): d = ln 1.5, ln 0.8, pad -> token ratios 1.5, 0.8;  sequence 1.2; geometric 1.2^(1/2)
"""

import math
from pathlib import Path

import pytest
import torch

from megamarl.cli.configure import load_config
from megamarl.config_sections import MismatchConfig, MismatchLevel
from megamarl.rl.losses import LossConfig, policy_loss
from megamarl.rl.mismatch import (
    mismatch_correction,
    mismatch_level_weights,
    mismatch_log_ratio,
    mismatch_metrics,
    mismatch_row_sums,
)
from megamarl.rl.policy_setup import loss_config
from megamarl.rl.update_metrics import AgentMismatch
from megamarl.runtime.step_metrics import policy_update_metrics

ln = math.log
NAN = float("nan")
GEO0, GEO1 = 4 ** (1 / 3), 1.2**0.5  # 1.587401, 1.095445
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "presets" / "signalling.yaml"


def close(actual, expected):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def batch():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rollout = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, NAN]])  # NaN in padding reaches nothing
    d = torch.tensor([[ln(2), ln(0.5), ln(4)], [ln(1.5), ln(0.8), NAN]])
    return rollout + d, rollout, mask


def test_log_ratio_per_level():
    old, rollout, mask = batch()
    close(
        mismatch_log_ratio(old, rollout, mask, level="token"),
        [[ln(2), ln(0.5), ln(4)], [ln(1.5), ln(0.8), 0]],
    )
    close(mismatch_log_ratio(old, rollout, mask, level="sequence"), [[ln(4)] * 3, [ln(1.2)] * 2 + [0]])
    close(
        mismatch_log_ratio(old, rollout, mask, level="geometric"), [[ln(4) / 3] * 3, [ln(1.2) / 2] * 2 + [0]]
    )
    with pytest.raises(ValueError, match="algorithm.mismatch"):
        mismatch_log_ratio(old, rollout, mask, level="word")


T, F = True, False
CASES = {
    # level, mode, lower, upper -> weights [2, 3], kept [2, 3]
    ("token", "truncate", None, 3.0): ([[2, 0.5, 3], [1.5, 0.8, 0]], [[T, T, T], [T, T, F]]),
    ("token", "mask", 0.6, 3.0): ([[2, 0, 0], [1.5, 0.8, 0]], [[T, F, F], [T, T, F]]),  # 0.5 < .6, 4 > 3
    ("token", "reject", 0.6, 3.0): (
        [[0, 0, 0], [1, 1, 0]],
        [[F, F, F], [T, T, F]],
    ),  # one token rejects row 0
    ("sequence", "truncate", None, 3.0): ([[3, 3, 3], [1.2, 1.2, 0]], [[T, T, T], [T, T, F]]),
    ("sequence", "mask", 0.6, 3.0): ([[0, 0, 0], [1.2, 1.2, 0]], [[F, F, F], [T, T, F]]),
    ("sequence", "reject", 0.6, 3.0): ([[0, 0, 0], [1, 1, 0]], [[F, F, F], [T, T, F]]),
    ("geometric", "truncate", None, 1.5): ([[1.5] * 3, [GEO1, GEO1, 0]], [[T, T, T], [T, T, F]]),
    ("geometric", "mask", 0.6, 1.5): ([[0, 0, 0], [GEO1, GEO1, 0]], [[F, F, F], [T, T, F]]),
    ("geometric", "reject", 0.6, 1.5): ([[0, 0, 0], [1, 1, 0]], [[F, F, F], [T, T, F]]),
    # one-sided bounds: the lower side alone drops row 1's geometric ratio 1.095 < 1.2
    ("geometric", "mask", 1.2, None): ([[GEO0] * 3, [0, 0, 0]], [[T, T, T], [F, F, F]]),
    ("token", "reject", 0.9, None): ([[0, 0, 0], [0, 0, 0]], [[F, F, F], [F, F, F]]),  # 0.5 and 0.8 < 0.9
}


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(str(x) for x in c) for c in CASES])
def test_every_level_and_mode(case):
    level, mode, lower, upper = case
    weights, kept = CASES[case]
    old, rollout, mask = batch()
    log_ratio = mismatch_log_ratio(old, rollout, mask, level=level)
    w, k = mismatch_level_weights(log_ratio, mask, mode=mode, lower=lower, upper=upper)
    close(w, weights)
    assert k.tolist() == kept
    # the same through the config, every other level off
    levels = {name: MismatchLevel() for name in ("token", "sequence", "geometric")}
    levels[level] = MismatchLevel(mode=mode, lower=lower, upper=upper)
    corr = mismatch_correction(old, rollout, mask, MismatchConfig(**levels))
    close(corr.weights, weights)
    assert corr.kept.tolist() == kept


def test_levels_multiply_and_truncation_is_counted():
    old, rollout, mask = batch()
    cfg = MismatchConfig(
        token=MismatchLevel(mode="truncate", upper=3.0),
        geometric=MismatchLevel(mode="reject", lower=0.6, upper=1.5),  # rejects row 0 (4^(1/3) > 1.5)
    )
    corr = mismatch_correction(old, rollout, mask, cfg)
    close(corr.weights, [[0, 0, 0], [1.5, 0.8, 0]])
    assert corr.kept.tolist() == [[F, F, F], [T, T, F]]
    assert corr.truncated.tolist() == [[F, F, T], [F, F, F]]  # token ratio 4 > 3
    close(corr.ratio, [[2, 0.5, 4], [1.5, 0.8, 0]])  # raw token ratios
    off = mismatch_correction(old, rollout, mask, MismatchConfig(token=MismatchLevel()))
    assert off.weights is None and off.kept.tolist() == mask.tolist()


def test_mismatch_sums_and_metrics_per_agent():
    old, rollout, mask = batch()
    kept = torch.tensor([[T, F, F], [F, F, F]])  # row 0: 2 tokens dropped; row 1: rejected
    sums = mismatch_row_sums(old, rollout, mask, kept)
    k3 = [r - 1 - ln(r) for r in (2, 0.5, 4, 1.5, 0.8)]  # KL(rollout || train), samples from rollout
    # columns: tokens, sum(train - rollout), sum k3, dropped tokens, sequences, rejected sequences
    close(sums, [[3, ln(4), sum(k3[:3]), 2, 1, 0], [2, ln(1.2), sum(k3[3:]), 2, 1, 1]])
    solver = mismatch_metrics(sums[0])
    assert solver == pytest.approx(
        {
            "mismatch_kl": (0.306853 + 0.193147 + 1.613706) / 3,  # 0.704569
            "mismatch_ppl_ratio": 4 ** (-1 / 3),  # exp(-mean(train - rollout)) = 0.629961
            "mismatch_masked_frac": 2 / 3,
            "mismatch_rejected_frac": 0.0,
        },
        abs=1e-6,
    )
    # near on-policy k3 ~ d^2 / 2 (fp32 exp(d) - 1 - d would round it to +-6e-8, often below 0)
    near = torch.tensor([[1e-4, -3e-4, 0.0]])
    tiny = mismatch_row_sums(near, torch.zeros(1, 3), mask[1:], mask[1:])
    d = near[0, :2].double()
    assert float(tiny[0, 2]) == pytest.approx(float((d**2 / 2 + d**3 / 6).sum()), rel=1e-6)
    both = mismatch_metrics(sums.sum(0))
    assert both["mismatch_kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)
    assert both["mismatch_masked_frac"] == pytest.approx(4 / 5) and both["mismatch_rejected_frac"] == 0.5

    acc = AgentMismatch()
    acc.add(["solver", "verifier"], sums)
    acc.add(["verifier"], sums[1:])  # a second micro-batch
    out = acc.metrics()
    assert set(out) == {f"agent/{a}/{k}" for a in ("solver", "verifier") for k in solver}
    assert out["agent/verifier/mismatch_ppl_ratio"] == pytest.approx(1.2**-0.5, abs=1e-6)  # 0.912871
    assert out["agent/verifier/mismatch_kl"] == pytest.approx(sum(k3[3:]) / 2, abs=1e-6)  # 0.0588395
    assert out["agent/verifier/mismatch_rejected_frac"] == 1.0
    # a worker's agent keys pass through the policy's naming unchanged
    assert (
        policy_update_metrics("shared", {"pg_loss": 1.0, **out})["agent/solver/mismatch_masked_frac"] == 2 / 3
    )


def test_policy_loss_applies_the_correction_and_reports_rows():
    old, rollout, mask = batch()
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    cfg = LossConfig(mismatch=MismatchConfig(token=MismatchLevel(mode="mask", lower=0.6, upper=3.0)))
    loss, m = policy_loss(lp, adv, mask, cfg, old_logprobs=old, rollout_logprobs=rollout)
    close(loss, -(2 + 1.5 + 0.8) / 5)  # ratio 1 to old: -A * w, token mean over 5 tokens
    close(m.tis_weight_mean, (2 + 1.5 + 0.8) / 5)
    close(m.tis_weight_max, 4.0)
    close(m.tis_clip_frac, 0.0)  # masked, not truncated
    assert m.mismatch_rows is not None and m.mismatch_rows[:, 3].tolist() == [2.0, 0.0]
    assert "mismatch_rows" not in m.as_dict()


@pytest.mark.parametrize(
    "level, key",
    [
        (MismatchLevel(mode="cut", upper=2.0), "algorithm.mismatch.token.mode='cut' unknown"),
        (MismatchLevel(mode="truncate"), "algorithm.mismatch.token.mode=truncate caps"),
        (MismatchLevel(mode="truncate", lower=0.5, upper=2.0), "set algorithm.mismatch.token.upper"),
        (MismatchLevel(mode="mask"), "algorithm.mismatch.token.mode=mask needs"),
        (MismatchLevel(mode="reject", lower=2.0, upper=1.0), "algorithm.mismatch.token.lower must be <"),
        (MismatchLevel(mode="mask", upper=-1.0), "algorithm.mismatch.token.upper must be > 0"),
    ],
)
def test_config_validation_names_the_key(level, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        MismatchConfig(token=level)


def test_config_keys_run_wide_per_policy_and_the_retired_tis_cap():
    cfg = load_config(
        CONFIG, ["algorithm.mismatch.geometric.mode=reject", "algorithm.mismatch.geometric.upper=1.01"]
    )
    assert cfg.algorithm.mismatch.geometric == MismatchLevel(mode="reject", upper=1.01)
    assert cfg.algorithm.mismatch.token == MismatchLevel(mode="truncate", upper=2.0)  # the default
    cfg = load_config(
        CONFIG,
        [
            "+policies.shared.algorithm.mismatch.token.mode=mask",
            "+policies.shared.algorithm.mismatch.token.lower=0.5",
        ],
    )
    policy = cfg.policy_algorithm("shared")
    assert policy.mismatch.token == MismatchLevel(mode="mask", lower=0.5, upper=2.0)
    assert loss_config(cfg.policies["shared"], policy).mismatch is policy.mismatch  # what the worker uses
    assert cfg.algorithm.mismatch.token.mode == "truncate"
    # a loss-only override: the driver's advantages stay run-wide
    assert cfg.policies["shared"].algorithm.advantage_overrides() == {}
    with pytest.raises(ValueError, match=r"policies.shared.algorithm.mismatch.sequence.mode=mask needs"):
        load_config(CONFIG, ["+policies.shared.algorithm.mismatch.sequence.mode=mask"])
    for overrides in (["algorithm.tis_cap=0"], ["+algorithm.tis_cap=0"]):
        with pytest.raises(
            ValueError, match=r"config key 'algorithm.tis_cap': removed; algorithm.mismatch replaces"
        ):
            load_config(CONFIG, overrides)


def test_retired_tis_cap_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "policies: {p: {model: tiny-random-llama}}\nagents: {sender: {policy: p}, receiver: {policy: p}}\n"
        "env: {name: signalling}\norchestra: {name: sequential}\nalgorithm: {tis_cap: 1.5}\n"
    )
    with pytest.raises(ValueError, match=r"config key 'algorithm.tis_cap': removed"):
        load_config(path)
