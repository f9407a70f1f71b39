"""Losses, KL, entropy, logprobs and the mismatch correction in the loss against hand-computed numbers
(the correction's own levels and modes: tests/unit/test_mismatch.py)."""

import math

import pytest
import torch

from megamarl.config_sections import MismatchConfig, MismatchLevel
from megamarl.rl.losses import (
    KL_K3_CLAMP,
    LOSS_AGGREGATIONS,
    LossConfig,
    entropy_from_logits,
    kl_k3,
    kl_penalty,
    loss_counts,
    policy_loss,
    ppo_clip_loss,
    token_logprobs,
)

NAN = float("nan")
OFF = MismatchConfig(token=MismatchLevel())  # no rollout/training mismatch correction
ln = math.log


def close(actual, expected):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_token_logprobs_alignment_temperature_and_chunks():
    logits = torch.tensor([[[0.0, 0.0], [ln(3), 0.0], [1e4, -1e4]]])  # last position predicts nothing
    tokens = torch.tensor([[1, 1, 0]])
    expected = [[0.0, ln(0.5), ln(0.75)]]
    close(token_logprobs(logits, tokens), expected)
    close(token_logprobs(logits, tokens, chunk_rows=1), expected)
    hot = torch.tensor([[[0.0, 0.0], [ln(9), 0.0], [0.0, 0.0]]])
    close(token_logprobs(hot, tokens, temperature=2.0), expected)


def test_entropy_from_logits_chunked():
    logits = torch.tensor([[[0.0, 0.0, -1e9, -1e9], [ln(3), 0.0, -1e9, -1e9], [0.0, 0.0, 0.0, 0.0]]])
    h_34 = -(0.75 * ln(0.75) + 0.25 * ln(0.25))
    close(entropy_from_logits(logits), [[ln(2), h_34, ln(4)]])
    close(entropy_from_logits(logits, chunk_rows=2), [[ln(2), h_34, ln(4)]])


def test_ppo_clip_cases_and_dual_clip():
    ratios = [1.5, 0.5, 1.1, 4.0, 0.5]
    lp = torch.tensor([[ln(r) for r in ratios] + [NAN]])  # last position is padding
    old = torch.zeros(1, 6)
    adv = torch.tensor([[1.0, 1, -1, -1, -1, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, clipped, dual = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # r=1.5,A=1 -> -1.2 (clipped); r=.5,A=1 -> -.5; r=1.1,A=-1 -> 1.1; r=4,A=-1 -> 4 capped at 3 (dual);
    # r=.5,A=-1 -> max(.5, .8) = .8 (clipped)
    close(loss, [[-1.2, -0.5, 1.1, 3.0, 0.8, 0.0]])
    assert clipped.tolist() == [[True, False, False, False, True, False]]
    assert dual.tolist() == [[False, False, False, True, False, False]]
    loss, _, dual = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=None)
    close(loss, [[-1.28, -0.5, 1.1, 4.0, 0.8, 0.0]])
    assert not dual.any()


def test_ppo_sequence_level_ratio():
    lp = torch.tensor([[ln(2), 0.0, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, _, _ = ppo_clip_loss(
        lp, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.5, ratio_level="sequence"
    )
    close(loss, [[-math.sqrt(2), -math.sqrt(2), 0]])  # exp(mean(ln2, 0)) = sqrt(2) < 1.5
    loss.sum().backward()
    close(lp.grad, [[-math.sqrt(2), -math.sqrt(2), 0]])


def test_kl_estimators():
    ref = torch.tensor([[0.0, 0.0, NAN]])
    lp = torch.tensor([[ln(2), -ln(2), 1.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    close(kl_penalty(lp, ref, mask, kind="k1"), [[ln(2), -ln(2), 0]])
    close(kl_penalty(lp, ref, mask, kind="k2"), [[0.5 * ln(2) ** 2, 0.5 * ln(2) ** 2, 0]])
    close(kl_penalty(lp, ref, mask, kind="k3"), [[0.5 - 1 + ln(2), 2 - 1 - ln(2), 0]])
    with pytest.raises(ValueError, match="loss.kl_type"):
        kl_penalty(lp, ref, mask, kind="k4")


def _agg_inputs():
    loss = torch.tensor([[1.0, 2, 3, 100], [4, NAN, 7, 7], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return loss, mask


@pytest.mark.parametrize(
    "mode, local, global_",
    [
        ("token-mean", 10 / 4, 10 / 8),  # global: num_tokens=8
        ("seq-mean-token-sum", (6 + 4) / 2, 10 / 4),  # global: num_seqs=4
        ("seq-mean-token-mean", (2 + 4) / 2, 6 / 4),
    ],
)
def test_aggregation_modes(mode, local, global_):
    loss, mask = _agg_inputs()
    agg = LOSS_AGGREGATIONS.get(mode)
    close(agg(loss, mask), local)
    close(agg(loss, mask, num_tokens=8, num_seqs=4), global_)
    # micro-batches with the global counts sum to the whole-batch loss
    parts = sum(agg(loss[rows], mask[rows], num_tokens=8, num_seqs=4) for rows in ([0], [1, 2]))
    close(parts, global_)


def _policy_inputs():
    # row 0: ratios 1.5, .5 with A=1; row 1: ratio 4 with A=-1, second position padding.
    lp = torch.tensor([[ln(1.5), ln(0.5)], [ln(4), NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    return lp, mask, torch.tensor([1.0, -1.0]), torch.zeros(2, 2)


def test_k3_clamped_item4():
    # issue #16 item 4: d = log pi - log pi_ref = -15 gave exp(15) - 1 - 15 = 3269001.37 as loss and
    # 1 - exp(15) as gradient; clamped like verl: loss 10, gradient 0. d = -1 is untouched: e - 2, 1 - e.
    lp = torch.tensor([-15.0, -1.0, 0.0], requires_grad=True)
    ref = torch.zeros(3)
    k3 = kl_k3(lp, ref)
    assert KL_K3_CLAMP == 10.0
    close(k3, [10.0, math.e - 2, 0.0])
    k3.sum().backward()
    close(lp.grad, [0.0, 1 - math.e, 0.0])
    unclamped = math.exp(15) - 1 - 15
    assert abs(unclamped - 3269001.37) < 0.01  # what the loss was before
    mask = torch.ones(1, 3, dtype=torch.bool)
    close(kl_penalty(lp[None].detach(), ref[None], mask, kind="k3"), [[10.0, math.e - 2, 0.0]])


def test_seq_mean_counts_skip_rows_without_response_item6():
    # issue #16 item 6: 4 rows, the last with no response token. Per-row token means .3, .2, .1:
    # seq-mean-token-mean = .6 / 3 = .2 (verl); dividing by all 4 rows gave .15.
    loss = torch.tensor([[0.3, 0.3, 0.0], [0.2, 0.0, 0.0], [0.1, 0.1, 0.1], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    counts = loss_counts(mask)
    assert counts == {"num_tokens": 6, "num_seqs": 3}
    close(LOSS_AGGREGATIONS.get("seq-mean-token-mean")(loss, mask, **counts), 0.2)
    close(LOSS_AGGREGATIONS.get("seq-mean-token-mean")(loss, mask, num_tokens=6, num_seqs=4), 0.15)
    # token sums .6, .2, .3 -> 1.1 / 3
    close(LOSS_AGGREGATIONS.get("seq-mean-token-sum")(loss, mask, **counts), 1.1 / 3)
    # the micro-batch split with the global counts adds up to the same value
    halves = sum(
        LOSS_AGGREGATIONS.get("seq-mean-token-mean")(loss[r], mask[r], **counts) for r in ([0, 3], [1, 2])
    )
    close(halves, 0.2)


def test_policy_loss_ppo_only():
    lp, mask, adv, old = _policy_inputs()
    loss, m = policy_loss(lp, adv, mask, LossConfig(mismatch=OFF), old_logprobs=old)
    close(loss.detach(), (-1.2 - 0.5 + 3.0) / 3)  # clipped, unclipped, dual-clipped
    close(m.clip_frac, 1 / 3)
    close(m.dual_clip_frac, 1 / 3)
    k3 = [1 / r - 1 + ln(r) for r in (1.5, 0.5, 4.0)]
    close(m.approx_kl, sum(k3) / 3)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[1, 1] == 0


def test_policy_loss_tis_kl_entropy_composed():
    lp, mask, adv, old = _policy_inputs()
    rollout = torch.tensor([[-ln(3), 0.0], [ln(2), NAN]])  # raw weights 3 (-> 2), 1, 0.5
    ref = torch.tensor([[ln(1.5) - ln(2), ln(0.5)], [ln(4), NAN]])  # k1 = ln2, 0, 0
    entropy = torch.tensor([[1.0, 2.0], [3.0, NAN]])
    cfg = LossConfig(kl_coef=0.1, kl_type="k1", entropy_coef=0.01)  # token TIS, cap 2
    loss, m = policy_loss(
        lp, adv, mask, cfg, old_logprobs=old, rollout_logprobs=rollout, ref_logprobs=ref, entropy=entropy
    )
    pg = (2 * -1.2 + 1 * -0.5 + 0.5 * 3.0) / 3
    close(m.pg_loss, pg)
    close(m.kl_loss, ln(2) / 3)
    close(m.entropy, 2.0)
    close(loss, pg + 0.1 * ln(2) / 3 - 0.01 * 2.0)
    close(m.tis_weight_mean, 3.5 / 3)
    close(m.tis_weight_max, 3.0)
    close(m.tis_clip_frac, 1 / 3)
    d = m.as_dict("solver/")
    assert set(d) == {
        "solver/" + k
        for k in (
            "loss",
            "pg_loss",
            "clip_frac",
            "dual_clip_frac",
            "approx_kl",
            "kl_loss",
            "entropy",
            "tis_weight_mean",
            "tis_weight_max",
            "tis_clip_frac",
        )
    }
    assert all(isinstance(v, float) for v in d.values())


def test_policy_loss_on_policy_default_ratio_one():
    lp, mask, adv, _ = _policy_inputs()
    loss, m = policy_loss(lp, adv, mask, LossConfig(mismatch=OFF, agg_mode="seq-mean-token-mean"))
    close(loss, ((-1 - 1) / 2 + 1) / 2)  # ratio 1: -A per token; row means -1 and +1
    close(m.approx_kl, 0.0)


def test_policy_loss_missing_inputs_raise():
    lp, mask, adv, _ = _policy_inputs()
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(lp, adv, mask, LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, adv, mask, LossConfig(mismatch=OFF, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, adv, mask, LossConfig(mismatch=OFF, entropy_coef=0.1))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"clip_low": 1.0}, "loss.clip_low"),
        ({"clip_high": -0.1}, "loss.clip_high"),
        ({"dual_clip": 1.0}, "loss.dual_clip"),
        ({"ratio_level": "word"}, "loss.ratio_level"),
        ({"kl_coef": -1.0}, "loss.kl_coef"),
        ({"entropy_coef": -1.0}, "loss.entropy_coef"),
        ({"kl_type": "k4"}, "loss.kl_type"),
        ({"agg_mode": "sum"}, "loss.agg_mode"),
    ],
)
def test_config_validation_names_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LossConfig(**kwargs)


def test_extra_padding_changes_nothing():
    lp, mask, adv, old = _policy_inputs()
    rollout = torch.tensor([[-ln(3), 0.0], [ln(2), 0.0]])
    cfg = LossConfig(agg_mode="seq-mean-token-mean")
    base, _ = policy_loss(lp, adv, mask, cfg, old_logprobs=old, rollout_logprobs=rollout)
    base.backward()

    def widen(x, fill):
        return torch.cat([x.detach(), torch.full((2, 3), fill, dtype=x.dtype)], dim=1)

    wide_lp = widen(lp, 7.0).requires_grad_()
    wide, _ = policy_loss(
        wide_lp,
        adv,
        widen(mask, False),
        cfg,
        old_logprobs=widen(old, NAN),
        rollout_logprobs=widen(rollout, -1e9),
    )
    wide.backward()
    close(wide.detach(), float(base.detach()))
    close(wide_lp.grad[:, :2], lp.grad.tolist())
    assert (wide_lp.grad[:, 2:] == 0).all()


def test_value_loss_clipped_by_hand():
    from megamarl.rl.losses import value_loss

    values = torch.tensor([[0.0, 1.0, 0.5, 9.0]])
    old = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 2.0, 0.0, 1.0]])
    mask = torch.tensor([[False, True, True, True]])
    loss, clipped = value_loss(values, old, returns, mask, clip=0.2)
    # t1: v=1 -> v_c=0.7; (1-2)^2=1 vs (0.7-2)^2=1.69 -> 0.845, clipped. t2: v=v_c=0.5; 0.25 -> 0.125.
    # t3: v=9 -> v_c=0.2; 64 vs 0.64 -> 32 (unclipped wins). t0 masked.
    torch.testing.assert_close(loss, torch.tensor([[0.0, 0.845, 0.125, 32.0]]))
    assert clipped.tolist() == [[False, True, False, False]]
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.0, 0.5, 0.125, 32.0]]))
