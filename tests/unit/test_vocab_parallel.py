"""Vocab-parallel logprobs/entropy: equal to log_softmax on one rank, and gradients match autograd."""

import torch

from megamarl.rl.vocab_parallel import vocab_parallel_logprobs


def _reference(logits, tokens):
    logp = torch.log_softmax(logits.double(), -1)
    lp = torch.gather(logp[:, :-1], -1, tokens[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(tokens.shape[0], 1, dtype=torch.double)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def test_matches_log_softmax_and_autograd():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, dtype=torch.double, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 6))
    lp, ent = vocab_parallel_logprobs(logits, tokens)
    ref_lp, ref_ent = _reference(logits, tokens)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-6, rtol=0)
    w1, w2 = torch.randn(3, 6), torch.randn(3, 6)
    (g,) = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref_lp * w1).sum() + (ref_ent * w2).sum(), logits)
    torch.testing.assert_close(g.double(), g_ref, atol=1e-6, rtol=0)


def test_padded_vocab_columns_take_no_mass():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 8)
    tokens = torch.randint(0, 6, (2, 4))
    lp, ent = vocab_parallel_logprobs(logits, tokens, vocab_size=6)
    ref_lp, ref_ent = _reference(logits[..., :6], tokens)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


def test_logit_window_equals_full_logits_from_its_offset_on():
    from megamarl.rl.forward import first_logit_position

    torch.manual_seed(2)
    logits = torch.randn(3, 7, 11, dtype=torch.double)
    tokens = torch.randint(0, 11, (3, 7))
    response = torch.zeros(3, 7, dtype=torch.bool)
    response[0, 4:6], response[1, 3:7], response[2, 5:6] = True, True, True
    offset = first_logit_position(response)
    assert offset == 2  # row 1's first response token (3) is predicted by the logits at 2
    full_lp, full_ent = vocab_parallel_logprobs(logits, tokens)
    lp, ent = vocab_parallel_logprobs(logits[:, offset:], tokens, offset=offset)
    assert lp.shape == tokens.shape
    torch.testing.assert_close(lp[:, offset + 1 :], full_lp[:, offset + 1 :], atol=0, rtol=0)
    torch.testing.assert_close(ent[:, offset + 1 :], full_ent[:, offset + 1 :], atol=0, rtol=0)
    assert (lp[:, : offset + 1] == 0).all() and torch.equal(lp * response, full_lp * response)
    assert first_logit_position(torch.zeros(2, 5, dtype=torch.bool)) == 0


def test_temperature_scaled_in_fp32_item9():
    # issue #16 item 9: bf16 logits at T=0.7. The reference scales the *same* bf16 values in fp64.
    # Dividing in bf16 rounds every scaled logit to 8 mantissa bits: tens of millinats of logprob error;
    # scale_logits divides in fp32: the error is fp32 round-off.
    from megamarl.rl.vocab_parallel import scale_logits

    torch.manual_seed(0)
    logits = (torch.randn(4, 16, 512) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 512, (4, 16))
    temperatures = (0.7, 0.7, 0.7, 0.7)
    reference, _ = _reference(logits.double() / 0.7, tokens)
    scaled = scale_logits(logits, temperatures)
    assert scaled.dtype == torch.float32
    lp, _ = vocab_parallel_logprobs(scaled, tokens)
    err = (lp.double() - reference).abs()
    assert err.max() < 2e-5, err.max()
    bf16_lp, _ = vocab_parallel_logprobs(logits / torch.tensor(0.7, dtype=torch.bfloat16), tokens)
    bf16_err = (bf16_lp.double() - reference).abs()
    assert bf16_err.mean() > 0.01 and bf16_err.max() > 0.05, (bf16_err.mean(), bf16_err.max())
    # per-row temperatures; all 1.0 only upcasts
    rows = scale_logits(logits[:2], (0.5, 2.0))
    torch.testing.assert_close(rows, torch.stack([logits[0].float() * 2, logits[1].float() / 2]))
    assert torch.equal(scale_logits(logits, (1.0,) * 4), logits.float())
