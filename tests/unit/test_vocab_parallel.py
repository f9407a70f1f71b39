"""Vocab-parallel logprobs/entropy: equal to log_softmax on one rank, and gradients match autograd."""

import pytest
import torch

from megamarl.rl import vocab_parallel
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


# ---- rows in chunks: the same numbers, no [rows, V] fp32 tensor kept for the backward pass ------------


def _unchunked(logits, tokens, vocab_size):
    """The reduction as one [rows, V] pass (before chunking), forward and its hand-written gradient."""
    z = logits.detach().float()
    if logits.shape[-1] > vocab_size:
        z = z.clone()
        z[..., vocab_size:] = float("-inf")
    z_max = z.max(dim=-1).values
    shifted = z - z_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    probs = exp / sum_exp.unsqueeze(-1)
    finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
    expected = (probs * finite).sum(dim=-1)
    index = tokens[:, 1:].clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    in_range = tokens[:, 1:] < logits.shape[-1]
    target = torch.gather(finite[:, :-1], -1, index).squeeze(-1) * in_range
    logprobs, entropy = target - sum_exp.log()[:, :-1], (sum_exp.log() - expected)[:, :-1]

    def grad(w_lp, w_ent):  # d (sum(lp * w_lp) + sum(ent * w_ent)) / d logits, rows [:, :-1]
        p, f = probs[:, :-1], finite[:, :-1]
        g = -p * w_lp.unsqueeze(-1)
        onehot = torch.zeros_like(p).scatter_(-1, index, in_range.unsqueeze(-1).to(p.dtype))
        g = g + onehot * w_lp.unsqueeze(-1)
        return g - p * (f - expected[:, :-1].unsqueeze(-1)) * w_ent.unsqueeze(-1)

    return logprobs, entropy, grad


@pytest.mark.parametrize("padded", [False, True])
def test_rows_in_chunks_equal_one_pass_exactly(monkeypatch, padded):
    """A chunk of 5 rows x 300 columns (6000 fp32 bytes) over 4 x 9 rows (some columns -inf, as a
    restricted vocabulary leaves them): log-probs, entropies and gradients bit-identical to the
    one-pass reduction, with and without padded vocabulary columns."""
    monkeypatch.setattr(vocab_parallel, "LOGPROB_CHUNK_BYTES", 5 * 300 * 4)
    torch.manual_seed(3)
    vocab_size = 290 if padded else 300
    logits = torch.randn(4, 10, 300) * 4
    logits[1, :, 17:40] = float("-inf")
    logits.requires_grad_(True)
    tokens = torch.randint(0, vocab_size, (4, 10))
    tokens[1, 3] = 5  # a finite column of the masked row
    lp, ent = vocab_parallel_logprobs(logits, tokens, vocab_size=vocab_size)
    ref_lp, ref_ent, ref_grad = _unchunked(logits, tokens, vocab_size)
    assert torch.equal(lp[:, 1:], ref_lp) and torch.equal(ent[:, 1:], ref_ent)
    w_lp, w_ent = torch.randn(4, 10), torch.randn(4, 10)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    assert torch.equal(grad[:, :-1], ref_grad(w_lp[:, 1:], w_ent[:, 1:]))
    assert torch.equal(grad[:, -1], torch.zeros(4, 300))  # the last position predicts nothing


def test_keeps_only_its_input_and_per_row_values_for_the_backward_pass():
    """What autograd holds between forward and backward: the logits themselves (the caller's tensor,
    not a copy) and O(rows) values; before, the probabilities and shifted logits ([rows, V] fp32 each)."""
    logits = torch.randn(2, 64, 5000, requires_grad=True)
    tokens = torch.randint(0, 5000, (2, 64))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vocab_parallel_logprobs(logits, tokens)
    vocab_sized = [t for t in saved if t.numel() >= 5000 * 8]
    assert len(vocab_sized) == 1 and vocab_sized[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved if t.numel() < 5000 * 8) < 10 * 2 * 64
