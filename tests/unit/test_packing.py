"""Sequence packing (``megamarl.rl.packing``): hand-computed index/mask arithmetic; logprobs from
packed logits equal ``vocab_parallel_logprobs`` on the padded rows; and on a tiny megatron-core
GPTModel (local spec, fp32, one spawned rank) the packed forward with the block-diagonal mask gives
the padded forward's logits, logprobs and gradients."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks
from megamarl.rl.packing import (
    pack,
    packed_logprobs,
    padded_shapes,
    padding_fraction,
    place_predictions,
    prediction_positions,
    split_by_tokens,
    unpack,
)
from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

# lengths 3, 2, 4 at width T = 4 (right padding with 0)
TOKENS = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]])
MASK = TOKENS != 0
RESPONSE = torch.tensor([[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)


# ---- split and padding ----------------------------------------------------------------------------


def test_split_by_tokens_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 12]
    # by length: 12(5) 9(1) 7(3) 5(0) 3(2) 2(4) into bins of <= 12 tokens, first bin with room
    assert split_by_tokens(lengths, 12) == [[5], [1, 2], [0, 3], [4]]
    assert split_by_tokens(torch.tensor(lengths), 12) == [[5], [1, 2], [0, 3], [4]]
    assert split_by_tokens(lengths, 12, max_samples=1) == [[5], [1], [3], [0], [2], [4]]
    assert split_by_tokens(lengths, 100, max_samples=4) == [
        [0, 1, 3, 5],
        [2, 4],
    ]  # the 4 longest, then the rest
    assert split_by_tokens([20, 3, 4], 10) == [[0], [1, 2]]  # the oversized row stands alone
    assert split_by_tokens([4, 4, 4], 8) == [[0, 1], [2]]  # ties: lower index first
    assert split_by_tokens([], 8) == []
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_tokens([1], 0)


def test_padding_fraction():
    lengths = [5, 9, 3, 7, 2, 12]
    shapes = padded_shapes(lengths, [[0, 1], [2, 3, 4, 5]])
    assert shapes == [(2, 9), (4, 12)]
    assert padding_fraction(lengths, shapes) == pytest.approx(1 - 38 / 66)
    assert padding_fraction(lengths, padded_shapes(lengths, [[i] for i in range(6)])) == 0.0
    assert padding_fraction([], []) == 0.0
    with pytest.raises(ValueError, match="do not fit"):
        padding_fraction([5, 5], [(1, 5)])


# ---- pack / unpack --------------------------------------------------------------------------------


def test_pack_hand_example():
    packed = pack(TOKENS, MASK)
    assert packed.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 9] and packed.cu_seqlens.dtype == torch.int32
    assert packed.sample_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert (packed.num_samples, packed.num_tokens, packed.seq_len, packed.max_seqlen) == (3, 9, 4, 4)
    assert packed.flat_index().tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    # row = query, column = key; "." = visible, "x" = masked (True)
    expected = [
        ".xxxxxxxx",
        "..xxxxxxx",
        "...xxxxxx",
        "xxx.xxxxx",
        "xxx..xxxx",
        "xxxxx.xxx",
        "xxxxx..xx",
        "xxxxx...x",
        "xxxxx....",
    ]
    mask = packed.causal_mask()
    assert mask.shape == (1, 1, 9, 9) and mask.dtype == torch.bool
    assert ["".join("x" if m else "." for m in row) for row in mask[0, 0].tolist()] == expected


def test_pack_rejects_left_padding():
    with pytest.raises(ValueError, match="right padding"):
        pack(TOKENS, torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool))


def test_unpack_places_values_and_is_differentiable():
    packed = pack(TOKENS, MASK)
    values = torch.arange(1.0, 10.0, requires_grad=True)  # [L]
    out = unpack(values.unsqueeze(0), packed)
    assert out.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    (out * torch.arange(12.0).view(3, 4)).sum().backward()
    assert values.grad.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]  # d/dv = the slot's weight
    wide = unpack(torch.arange(18.0).view(9, 2), packed, seq_len=5)  # [L, 2] -> [B, 5, 2]
    assert wide.shape == (3, 5, 2) and wide[1, 1].tolist() == [8, 9] and wide[1, 2:].abs().sum() == 0


# ---- prediction positions and logprobs --------------------------------------------------------------


def test_prediction_positions_skip_sample_ends():
    packed = pack(TOKENS, MASK)
    # sample ends 2, 4, 8 predict the next sample's first token (or nothing): never selected
    assert prediction_positions(packed).tolist() == [0, 1, 3, 5, 6, 7]
    # response tokens (0, 2), (1, 1), (2, 2), (2, 3) sit at packed 2, 4, 7, 8; predicted from one before
    assert prediction_positions(packed, RESPONSE).tolist() == [1, 3, 6, 7]
    placed = place_predictions(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed, torch.tensor([1, 3, 6, 7]))
    assert placed.tolist() == [[0, 0, 1, 0], [0, 2, 0, 0], [0, 0, 3, 4]]


def _random_logits(seed=0, vocab=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, vocab, generator=g) * 3  # padded [B, T, V]


def test_packed_logprobs_match_padded_and_never_leak():
    padded_logits = _random_logits()
    ref_lp, ref_ent = vocab_parallel_logprobs(padded_logits, TOKENS, vocab_size=35)
    real = MASK.clone()
    real[:, 0] = False  # j = 0 has no prediction
    packed = pack(TOKENS, MASK)
    logits = padded_logits[MASK].unsqueeze(0).clone()  # [1, L, V]: the logits a packed forward gives
    logits[0, [2, 4, 8]] = float("nan")  # sample ends: must never be read
    logits.requires_grad_(True)
    lp, ent = packed_logprobs(logits, packed, vocab_size=35)
    assert lp.shape == ent.shape == (3, 4)
    torch.testing.assert_close(lp, ref_lp * real, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent * real, rtol=0, atol=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, [2, 4, 8]].abs().sum() == 0


def test_packed_logprobs_on_selected_rows():
    padded_logits = _random_logits(seed=1)
    ref_lp, ref_ent = vocab_parallel_logprobs(padded_logits, TOKENS)
    packed = pack(TOKENS, MASK)
    full = padded_logits[MASK].unsqueeze(0)  # [1, L, V]
    positions = prediction_positions(packed, RESPONSE)  # what the output-layer hook keeps
    lp, ent = packed_logprobs(full[:, positions], packed, positions=positions)
    torch.testing.assert_close(lp, ref_lp * RESPONSE, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent * RESPONSE, rtol=0, atol=1e-6)
    # every position including sample ends == the whole row: the ends are dropped
    every = torch.arange(packed.num_tokens)
    torch.testing.assert_close(
        packed_logprobs(full, packed, positions=every)[0], packed_logprobs(full, packed)[0]
    )
    # no response token at all: K = 0 rows, all-zero output
    none = prediction_positions(packed, torch.zeros_like(RESPONSE))
    empty = packed_logprobs(full[:, none], packed, positions=none)
    assert none.numel() == 0 and empty[0].abs().sum() == 0 and empty[0].shape == (3, 4)
    with pytest.raises(ValueError, match="must be"):
        packed_logprobs(full, packed, positions=positions)


# ---- a tiny megatron-core GPTModel: packed forward == padded forward ----------------------------------


def _tiny_megatron(rank):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megamarl.models import bridge
    from megamarl.models.tiny import tiny_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.forward import causal_mask

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    hf = tiny_model("qwen2", vocab_size=300, num_hidden_layers=2)  # GQA, QKV bias, untied output
    model = bridge.build_model(hf.config, wg, init_weights=False)
    bridge.load_hf_weights(model, hf.state_dict(), wg)
    gpt = bridge.unwrap(model)
    g = torch.Generator().manual_seed(0)
    lengths = [7, 12, 3, 10]
    num_rows, width = len(lengths), max(lengths)
    tokens = torch.randint(1, 300, (num_rows, width), generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    tokens = tokens.masked_fill(~mask, 0)
    response = mask & (torch.arange(width)[None, :] >= torch.tensor([4, 5, 1, 6])[:, None])
    packed = pack(tokens, mask)
    out = {}

    params = [p for p in model.parameters() if p.requires_grad]

    def run(forward):  # -> (logits, logprobs, entropy, grads) of sum(logprobs * response)
        model.zero_grad(set_to_none=True)
        logits, lp, ent = forward()
        (lp * response).sum().backward()
        return logits.detach(), lp.detach(), ent.detach(), [p.grad.clone() for p in params]

    def padded():
        positions = torch.arange(width).expand(num_rows, width)
        logits = model(tokens, positions, causal_mask(width))
        return (logits, *vocab_parallel_logprobs(logits, tokens))

    def packed_row():
        logits = model(packed.tokens, packed.position_ids, packed.causal_mask())  # [1, L, V]
        return (unpack(logits, packed), *packed_logprobs(logits, packed))

    def packed_selected():  # the output layer on K prediction rows only (a pre-hook, as LogitWindow)
        positions = prediction_positions(packed, response)
        hook = gpt.output_layer.register_forward_pre_hook(lambda m, args: (args[0][positions],) + args[1:])
        try:
            logits = model(packed.tokens, packed.position_ids, packed.causal_mask())  # [1, K, V]
        finally:
            hook.remove()
        out["selected_rows"] = (logits.shape[1], packed.num_tokens)
        return (logits, *packed_logprobs(logits, packed, positions=positions))

    ref_logits, ref_lp, ref_ent, ref_grads = run(padded)
    real = mask.clone()
    real[:, 0] = False
    for name, forward in (("row", packed_row), ("selected", packed_selected)):
        logits, lp, ent, grads = run(forward)
        keep = real if name == "row" else response
        if name == "row":
            out["row_logits"] = (logits - ref_logits)[mask].abs().max().item()
        out[f"{name}_logprobs"] = (lp - ref_lp * keep).abs().max().item()
        out[f"{name}_entropy"] = (ent - ref_ent * keep).abs().max().item()
        out[f"{name}_grads"] = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
    out["grad_scale"] = max(g.abs().max().item() for g in ref_grads)
    # negative control: a plain causal mask over the packed row lets later samples see earlier ones
    with torch.no_grad():
        leaky = unpack(model(packed.tokens, packed.position_ids, causal_mask(packed.num_tokens)), packed)
    out["leaky_logits"] = (leaky - ref_logits)[mask].abs().max().item()
    params_te = packed.seq_params()
    out["seq_params"] = (
        isinstance(params_te, PackedSeqParams),
        params_te.qkv_format,
        params_te.cu_seqlens_q.tolist(),
        params_te.max_seqlen_kv,
    )
    return out


def test_packed_forward_matches_padded_on_tiny_megatron(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    (r,) = run_ranks(_tiny_megatron, 1, timeout_s=300)
    assert r["row_logits"] <= 1e-5, r
    for name in ("row", "selected"):
        assert r[f"{name}_logprobs"] <= 1e-5 and r[f"{name}_entropy"] <= 1e-5, r
        # fp32 sums over B*T vs L positions in another order: equal to 1e-6 relative (abs ~1e-5 of ~10)
        assert r[f"{name}_grads"] <= 1e-5 * r["grad_scale"], r
    assert r["grad_scale"] > 1.0, r  # the gradients compared are not all ~0
    assert r["selected_rows"][0] < r["selected_rows"][1] - 10, r
    assert r["leaky_logits"] > 1e-2, r  # the block-diagonal mask is what keeps samples apart
    assert r["seq_params"] == (True, "thd", [0, 7, 19, 22, 32], 12), r
