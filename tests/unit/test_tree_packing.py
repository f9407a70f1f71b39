"""Prefix-tree packing (``megamarl.rl.tree``): the trie, its ancestor mask and depths by hand; and on a
tiny megatron-core GPTModel (local spec, fp32, one spawned rank) the tree forward gives the padded
forward's logits, logprobs, entropies and gradients, while a wrong mask or wrong positions do not."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks
from megamarl.rl.tree import place_tree, split_by_tree_tokens, tree_pack, tree_tokens

# a group of two sharing the prompt 5 6 7, a third row whose prefix is the first row (a later turn of
# the same transcript), and an unrelated row; right padding with 0
TOKENS = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 9, 10, 0], [5, 6, 7, 8, 11, 12], [3, 4, 0, 0, 0, 0]])
MASK = TOKENS != 0


def test_trie_nodes_depths_and_ancestor_mask_by_hand():
    tree = tree_pack(TOKENS, MASK)
    # DFS preorder (rows inserted in token order: row 3, row 0, row 2, row 1): 3 4 | 5 6 7 8 11 12 | 9 10
    assert tree.tokens.tolist() == [[3, 4, 5, 6, 7, 8, 11, 12, 9, 10]]
    assert tree.position_ids.tolist() == [[0, 1, 0, 1, 2, 3, 4, 5, 3, 4]]
    assert tree.parents.tolist() == [-1, 0, -1, 2, 3, 4, 5, 6, 4, 8]
    assert tree.ends.tolist() == [2, 2, 10, 10, 10, 8, 8, 8, 10, 10]  # subtree of n: [n, ends[n])
    assert tree.node_of.tolist() == [
        [2, 3, 4, 5, -1, -1],
        [2, 3, 4, 8, 9, -1],
        [2, 3, 4, 5, 6, 7],
        [0, 1, -1, -1, -1, -1],
    ]
    visible = ~tree.causal_mask()[0, 0]
    assert [torch.nonzero(visible[n]).squeeze(1).tolist() for n in range(10)] == [
        [0],
        [0, 1],
        [2],
        [2, 3],
        [2, 3, 4],
        [2, 3, 4, 5],
        [2, 3, 4, 5, 6],
        [2, 3, 4, 5, 6, 7],
        [2, 3, 4, 8],
        [2, 3, 4, 8, 9],
    ]
    nodes = torch.arange(10)  # the interval test is the same mask
    assert torch.equal(visible, (nodes[None, :] <= nodes[:, None]) & (nodes[:, None] < tree.ends[None, :]))
    assert tree.num_tokens == tree_tokens(TOKENS, MASK) == 10 < int(MASK.sum()) == 17
    response = torch.zeros_like(MASK)
    response[:, 3:] = True
    preds = tree.predictions(response & MASK)
    # (sample, column) -> the node of its previous token; node 4 predicts for three samples (8, 9, 8)
    assert list(
        zip(preds.samples.tolist(), preds.columns.tolist(), preds.positions.tolist(), preds.targets.tolist())
    ) == [(0, 3, 4, 8), (1, 3, 4, 9), (1, 4, 8, 10), (2, 3, 4, 8), (2, 4, 5, 11), (2, 5, 6, 12)]
    placed = place_tree(torch.arange(1.0, 7.0), preds, 4, 6)
    assert placed.tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 3, 0], [0, 0, 0, 4, 5, 6], [0] * 6]


def test_split_by_tree_tokens_keeps_shared_prefixes_together():
    # lexicographic order: row 3 (3 4), then rows 0, 2 (5 6 7 8 ...), then row 1 (5 6 7 9 10)
    assert split_by_tree_tokens(TOKENS, MASK, 100) == [[0, 1, 2, 3]]
    assert split_by_tree_tokens(TOKENS, MASK, 8) == [[0, 2, 3], [1]]  # 2 + 4 + 2 nodes, then row 1 alone
    assert split_by_tree_tokens(TOKENS, MASK, 100, max_samples=2) == [[0, 3], [1, 2]]
    assert split_by_tree_tokens(TOKENS, MASK, 3) == [[3], [0], [2], [1]]  # rows over budget stand alone
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_tree_tokens(TOKENS, MASK, 0)


# ---- a tiny megatron-core GPTModel: tree forward == padded forward ------------------------------------


def _tiny_tree(rank):
    from megamarl.models import bridge
    from megamarl.models.tiny import tiny_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.forward import causal_mask
    from megamarl.rl.tree import RotaryPositions, tree_logprobs
    from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    hf = tiny_model("qwen2", vocab_size=300, num_hidden_layers=2)  # GQA, QKV bias, untied output
    model = bridge.build_model(hf.config, wg, init_weights=False)
    bridge.load_hf_weights(model, hf.state_dict(), wg)
    gpt = bridge.unwrap(model)
    rotary = RotaryPositions(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 300, (9,), generator=g).tolist()
    rows = [prompt + torch.randint(1, 300, (n,), generator=g).tolist() for n in (4, 6, 3)]
    rows.append(rows[0] + torch.randint(1, 300, (5,), generator=g).tolist())  # a later turn of row 0
    rows.append(torch.randint(1, 300, (7,), generator=g).tolist())  # unrelated
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    response = mask & (torch.arange(width)[None, :] >= torch.tensor([9, 9, 9, 13, 2])[:, None])
    tree = tree_pack(tokens, mask)
    preds = tree.predictions(response)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"nodes": (tree.num_tokens, int(mask.sum()))}

    def run(forward):  # -> (logprobs, entropy, grads) of sum(logprobs * response)
        model.zero_grad(set_to_none=True)
        lp, ent = forward()
        (lp * response).sum().backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in params]

    def padded():
        positions = torch.arange(width).expand(len(rows), width)
        return vocab_parallel_logprobs(model(tokens, positions, causal_mask(width)), tokens)

    def tree_forward(attention_mask=None, positions=tree.position_ids[0]):
        hook = gpt.output_layer.register_forward_pre_hook(
            lambda m, args: (args[0][preds.positions],) + args[1:]
        )
        rotary.positions = positions
        try:
            logits = model(
                tree.tokens,
                tree.position_ids,
                tree.causal_mask() if attention_mask is None else attention_mask,
            )  # [1, K, V]
        finally:
            hook.remove()
            rotary.positions = None
        return tree_logprobs(logits, tree, preds)

    ref_lp, ref_ent, ref_grads = run(padded)
    lp, ent, grads = run(tree_forward)
    out["logprobs"] = (lp - ref_lp * response).abs().max().item()
    out["entropy"] = (ent - ref_ent * response).abs().max().item()
    out["grads"] = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
    out["grad_scale"] = max(g.abs().max().item() for g in ref_grads)
    # mutations the equivalence must catch: a plain causal mask over the layout (siblings see each
    # other), the layout index as the position (RoPE off by the skipped siblings), no re-indexing at all
    with torch.no_grad():
        for name, kwargs in (
            ("causal_mask", {"attention_mask": causal_mask(tree.num_tokens)}),
            ("layout_positions", {"positions": torch.arange(tree.num_tokens)}),
            ("no_positions", {"positions": None}),
        ):
            out[name] = (tree_forward(**kwargs)[0] - ref_lp * response).abs().max().item()
    return out


def test_tree_forward_matches_padded_on_tiny_megatron(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    (r,) = run_ranks(_tiny_tree, 1, timeout_s=300)
    assert r["nodes"][0] < r["nodes"][1] - 20, r  # the shared prompt and the earlier turn laid out once
    assert r["logprobs"] <= 1e-5 and r["entropy"] <= 1e-5, r
    # fp32 sums in another order (a shared node's gradient sums its samples'): equal to 1e-6 relative
    assert r["grads"] <= 1e-5 * r["grad_scale"], r
    assert r["grad_scale"] > 1.0, r
    assert min(r["causal_mask"], r["layout_positions"], r["no_positions"]) > 1e-2, r


def test_prefix_tree_runs_on_te_nodes_and_is_rejected_before_any_model_loads_where_it_cannot_run():
    from pathlib import Path

    from megamarl.cli.configure import load_config
    from megamarl.cli.front_door import check_layer_specs

    config = Path(__file__).resolve().parents[2] / "configs" / "signalling_tiny.yaml"
    with pytest.raises(ValueError, match=r"policies\.shared\.prefix_tree is a way of packing"):
        load_config(config, ["policies.shared.prefix_tree=true"])
    cfg = load_config(
        config,
        [
            "policies.shared.pack=true",
            "policies.shared.prefix_tree=true",
            "cluster.num_nodes=1",
            "cluster.gpus_per_node=1",
        ],
    )
    check_layer_specs(cfg, cuda=False, transformer_engine=False)  # CPU: the local spec takes the tree mask
    check_layer_specs(cfg, cuda=True, transformer_engine=True, triton=True)  # TE's spec, flex attention
    with pytest.raises(ValueError, match=r"policies\.shared\.prefix_tree: tree attention on CUDA is flex"):
        check_layer_specs(cfg, cuda=True, transformer_engine=True, triton=False)  # nothing compiles it
