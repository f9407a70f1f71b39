"""Flex tree attention (``megamarl.models.tree_attention``): on random prefix trees of several levels
(a group prompt, turns, replies; a second root) its block mask says exactly what the dense ancestor
mask says (full blocks all visible, skipped blocks none), an off-by-one in the subtree ends is caught,
and ``FlexTreeAttention`` gives the dense-mask attention's outputs and gradients (GQA; fp32, 1e-5
absolute); on the tiny megatron-core model (one spawned rank, local spec's linears) the tree forward
with it gives the dense-mask tree forward's and the unshared packed forward's log-probs and gradients.
Eager flex attention ignores block sparsity, so the blocks are checked on their own, and once through
the compiled CPU kernel (slow)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from flex_cpu import flex_backward_on_cpu  # tests/ helper: flex's eager backward on a CPU

from megamarl.models.tree_attention import FlexTreeAttention, block_mask_bytes, tree_block_mask
from megamarl.parallel.launch import run_ranks
from megamarl.rl.tree import tree_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _rows(seed: int, *, prompt: int = 7, vocab: int = 50) -> list[list[int]]:
    """Rows of a team transcript: a group prompt, two turns of replies on it, a reply repeated, and an
    unrelated root (the rows shuffled: tree_pack must lay them out in preorder whatever their order)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    base = ids(prompt)
    turn1 = [base + ids(int(n)) for n in torch.randint(2, 6, (3,), generator=g)]
    turn2 = [turn1[i] + ids(int(n)) for i, n in enumerate(torch.randint(1, 5, (3,), generator=g))]
    rows = turn1 + turn2 + [turn2[0] + ids(3), turn1[1], ids(5)]
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order]


def _tree(rows):
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    return tree_pack(tokens, torch.arange(width)[None, :] < lengths[:, None])


def _blocks(num_blocks: torch.Tensor, indices: torch.Tensor, size: int) -> torch.Tensor:
    """[nq, nkv] bool of the blocks a BlockMask lists."""
    out = torch.zeros(indices.shape[-2], indices.shape[-1], dtype=torch.bool)
    for q in range(out.shape[0]):
        out[q, indices[0, 0, q, : num_blocks[0, 0, q]].long()] = True
    return out.repeat_interleave(size, 0).repeat_interleave(size, 1)


def _effective(ends: torch.Tensor, num: int, block_size: int):
    """(what a block-sparse kernel attends: full blocks whole, partial blocks through the mask_mod;
    the partial and full block maps), each [N, N]."""
    bm = tree_block_mask(ends, block_size=block_size)
    partial = _blocks(bm.kv_num_blocks, bm.kv_indices, block_size)[:num, :num]
    full = _blocks(bm.full_kv_num_blocks, bm.full_kv_indices, block_size)[:num, :num]
    nodes = torch.arange(num)
    mod = bm.mask_mod(0, 0, nodes[:, None], nodes[None, :])
    return full | (partial & mod), partial, full


@pytest.mark.parametrize("block_size", [2, 4, 8, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_mask_is_the_ancestor_mask(seed, block_size):
    tree = _tree(_rows(seed))
    num = tree.num_tokens
    visible = ~tree.causal_mask()[0, 0]  # built from the parents, not from the intervals
    effective, partial, full = _effective(tree.ends, num, block_size)
    assert torch.equal(effective, visible)
    assert not (full & ~visible).any()  # a full block skips the mask_mod: it must be all visible
    assert not (visible & ~(partial | full)).any()  # a skipped block holds nothing visible
    assert not (partial & full).any()
    if block_size <= 4:
        assert full.any() and (~(partial | full)).any()  # the case exercises all three kinds


def test_an_off_by_one_in_the_subtree_ends_is_caught():
    tree = _tree(_rows(0))
    visible = ~tree.causal_mask()[0, 0]
    internal = tree.ends > torch.arange(tree.num_tokens) + 1  # nodes with descendants
    for shift in (1, -1):
        ends = torch.where(internal, tree.ends + shift, tree.ends).clamp(max=tree.num_tokens)
        for block_size in (4, 128):
            assert not torch.equal(_effective(ends, tree.num_tokens, block_size)[0], visible)


def test_block_mask_bytes_are_the_objects_bytes():
    for num in (10, 128, 129, 1000):
        ends = _tree(_rows(0, prompt=num)).ends if num > 100 else _tree(_rows(0)).ends[:num].clamp(max=num)
        bm = tree_block_mask(ends)
        tensors = [t for t in bm.as_tuple(flatten=True) if isinstance(t, torch.Tensor)]
        padded = -(-ends.numel() // 128) * 128
        held = sum(t.numel() * t.element_size() for t in tensors) + 8 * padded  # + the padded ends
        assert block_mask_bytes(ends.numel()) == held, (num, held)
    assert block_mask_bytes(16384) == 8 * 16384 + 16 * (128 + 128**2)  # 396 KiB for 16k nodes


def _config(**keys):
    fields = {
        "attention_dropout": 0.0,
        "context_parallel_size": 1,
        "window_size": None,
        "softmax_type": "vanilla",
        "kv_channels": 8,
    }
    return SimpleNamespace(**{**fields, **keys})


def _dense_attention(query, key, value, mask, scale):
    """megatron-core's DotProductAttention math: GQA by repeating key/value heads, masked fp32 softmax."""
    groups = query.shape[2] // key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], 1, -1)


def test_flex_tree_attention_equals_dense_mask_attention_with_gqa():
    tree = _tree(_rows(1))
    num, heads, groups, dim = tree.num_tokens, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(num, 1, h, dim, generator=g) for h in (heads, groups, groups)]
    attention = FlexTreeAttention(_config(), 1, None, "self")
    grads = {}
    for name in ("flex", "dense"):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        if name == "flex":
            with flex_backward_on_cpu():
                out = attention(q, k, v, tree.subtree_ends())
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        else:
            out = _dense_attention(q, k, v, tree.causal_mask()[0, 0], 1 / dim**0.5)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[name] = [out.detach(), q.grad, k.grad, v.grad]
    assert grads["flex"][0].shape == (num, 1, heads * dim)
    for a, b in zip(grads["flex"], grads["dense"], strict=True):
        assert (a - b).abs().max() <= 1e-5, (a - b).abs().max()
    with torch.no_grad():  # the mutation reaches the output too
        wrong = tree.subtree_ends().clone()
        wrong[0, 2] -= 1
        assert (attention(*inputs, wrong) - grads["dense"][0]).abs().max() > 1e-2


def test_flex_tree_attention_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="attention_dropout"):
        FlexTreeAttention(_config(attention_dropout=0.1), 1, None, "self")
    tree = _tree(_rows(0))
    q = torch.zeros(tree.num_tokens, 1, 2, 8)
    with pytest.raises(TypeError, match="subtree ends"):
        FlexTreeAttention(_config(), 1, None, "self")(q, q, q, tree.causal_mask())


@pytest.mark.slow
def test_the_compiled_cpu_kernel_reads_the_block_mask():
    """Forward only (torch compiles no CPU backward for flex attention): a shared prompt of 300 nodes
    and a second root of 90 make full, partial and skipped 128-blocks; the sparse kernel must equal the
    dense mask; the next micro-batch of that length reuses the compiled kernel."""
    g = torch.Generator().manual_seed(3)
    prompt = [1] + torch.randint(2, 50, (299,), generator=g).tolist()  # sorts first: nodes 0..299
    replies = [prompt + torch.randint(2, 50, (5,), generator=g).tolist() for _ in range(4)]
    tree = _tree(replies + [list(range(60, 150))])
    num, dim = tree.num_tokens, 16
    query, key, value = (torch.randn(num, 1, h, dim, generator=g) for h in (4, 2, 2))
    bm = tree_block_mask(tree.ends)
    num_blocks = bm.kv_indices.shape[-1]
    assert (
        0 < int(bm.full_kv_num_blocks.sum()) < int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
    )
    assert int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()) < num_blocks * (num_blocks + 1) // 2
    compiled = torch.compile(torch.nn.attention.flex_attention.flex_attention)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = compiled(q, k, v, block_mask=bm, scale=dim**-0.5, enable_gqa=True).permute(2, 0, 1, 3)
    dense = _dense_attention(query, key, value, tree.causal_mask()[0, 0], dim**-0.5)
    assert (out.reshape(num, 1, -1) - dense).abs().max() <= 1e-5
    # the next micro-batch of the same length: a new block mask and mask_mod closure, no recompile
    chain = torch.full_like(tree.ends, num)  # one chain of num nodes: every ancestor of every later node
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = compiled(q, k, v, block_mask=tree_block_mask(chain), scale=dim**-0.5, enable_gqa=True)
    causal = torch.ones(num, num, dtype=torch.bool).triu(1)
    dense = _dense_attention(query, key, value, causal, dim**-0.5)
    assert (again.permute(2, 0, 1, 3).reshape(num, 1, -1) - dense).abs().max() <= 1e-5


# ---- the tiny megatron-core model: flex tree forward == dense-mask tree forward == packed forward -----


def _model_body(rank):
    from flex_cpu import flex_backward_on_cpu

    from megamarl.models import bridge
    from megamarl.models.tiny import tiny_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.batch import collate
    from megamarl.rl.forward import LogitWindow, packed_forward, sampled_logprobs, tree_forward
    from megamarl.rl.policy_setup import RECOMPUTE
    from megamarl.rl.sample import Sample
    from megamarl.rl.tree import RotaryPositions

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    hf = tiny_model("qwen2", vocab_size=300, num_hidden_layers=2)  # GQA (4 heads, 2 groups), QKV bias
    models = {}
    for kind in ("mask", "flex", "flex_selective", "flex_full"):  # flex with core attention / each layer
        recompute = RECOMPUTE[kind.split("_")[1]] if "_" in kind else {}  # rebuilt in backward
        model = bridge.build_model(
            hf.config, wg, init_weights=False, tree_attention=kind.split("_")[0], **recompute
        )
        bridge.load_hf_weights(model, hf.state_dict(), wg)
        models[kind] = model
    hooks = {kind: (LogitWindow(m), RotaryPositions(m)) for kind, m in models.items()}  # once per model
    out = {
        "kinds": {k: m.tree_attention for k, m in models.items() if "_" not in k},
        "core": type(models["flex"].decoder.layers[0].self_attention.core_attention).__name__,
    }
    rows = _rows(4, prompt=9, vocab=300)
    samples = [
        Sample(
            task_id="t",
            episode_id=f"e{i}",
            agent="a",
            policy="p",
            turn=0,
            prompt_ids=row[: len(row) // 2],
            response_ids=row[len(row) // 2 :],
            rollout_logprobs=[0.0] * (len(row) - len(row) // 2),
        )
        for i, row in enumerate(rows)
    ]
    mb = collate(samples, pad_id=0)
    response = mb.response_mask

    def run(kind, forward):  # -> (logprobs, grads) of sum(logprobs * response * weights)
        model = models[kind]
        model.zero_grad(set_to_none=True)
        output, where = forward(model, *hooks[kind])
        logprobs, _ = sampled_logprobs(output, mb, where, tp_group=None, vocab_start=0, vocab_size=300)
        weights = torch.linspace(-1.0, 1.0, response.numel()).view_as(logprobs)
        (logprobs * response * weights).sum().backward()
        params = [p for p in model.parameters() if p.requires_grad]
        return (logprobs * response).detach(), [p.grad.clone() for p in params]

    def tree(model, window, rotary):
        return tree_forward(model, window, rotary, mb)

    def packed(model, window, rotary):
        return packed_forward(model, window, mb, uses_te=False)

    results = {"packed": run("mask", packed), "mask": run("mask", tree)}
    with flex_backward_on_cpu():
        for kind in ("flex", "flex_selective", "flex_full"):
            results[kind] = run(kind, tree)
    scale = max(g.abs().max().item() for g in results["packed"][1])
    for name in ("mask", "packed"):
        lp, grads = results[name]
        out[f"flex_vs_{name}_logprobs"] = (results["flex"][0] - lp).abs().max().item()
        out[f"flex_vs_{name}_grads"] = max(
            (a - b).abs().max().item() for a, b in zip(results["flex"][1], grads)
        )
    for kind in ("flex_selective", "flex_full"):
        out[f"{kind}_grads"] = max(
            (a - b).abs().max().item() for a, b in zip(results[kind][1], results["flex"][1])
        )
    out["mask_vs_packed_grads"] = max(
        (a - b).abs().max().item() for a, b in zip(results["mask"][1], results["packed"][1])
    )
    out["grad_scale"] = scale
    # a mutated interval (one subtree end one short) must move the log-probs
    flex = models["flex"]
    tree_batch = tree_pack(mb.tokens, mb.attention_mask)
    ends = tree_batch.subtree_ends().clone()
    ends[0, int(torch.nonzero(ends[0] > torch.arange(ends.numel()) + 1)[0])] -= 1
    window, rotary = hooks["flex"]
    window.select(torch.arange(tree_batch.num_tokens))
    rotary.positions = tree_batch.position_ids[0]
    with torch.no_grad():
        good = flex(tree_batch.tokens, tree_batch.position_ids, tree_batch.subtree_ends())
        bad = flex(tree_batch.tokens, tree_batch.position_ids, ends)
    out["mutated_ends"] = (good - bad).abs().max().item()
    out["nodes"] = (tree_batch.num_tokens, int(mb.attention_mask.sum()))
    return out


def test_flex_tree_forward_on_tiny_megatron_equals_dense_mask_and_packed(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    (r,) = run_ranks(_model_body, 1, timeout_s=300)
    assert r["kinds"] == {"mask": "mask", "flex": "flex"} and r["core"] == "FlexTreeAttention", r
    assert r["nodes"][0] < r["nodes"][1] - 20, r  # the prompt, turns and the repeated reply shared
    # fp32: log-probs within 1e-5; gradients within 1e-5 of the largest (sums in another order)
    assert r["flex_vs_mask_logprobs"] <= 1e-5 and r["flex_vs_packed_logprobs"] <= 1e-5, r
    assert r["flex_vs_mask_grads"] <= 1e-5 * r["grad_scale"], r
    assert r["flex_vs_packed_grads"] <= 1e-5 * r["grad_scale"], r
    assert r["grad_scale"] > 1e-2, r
    # recompute: the subtree ends travel as the attention-mask argument, so a rebuilt layer has them
    assert (
        r["flex_selective_grads"] <= 1e-6 * r["grad_scale"] and r["flex_full_grads"] <= 1e-6 * r["grad_scale"]
    ), r
    assert r["mutated_ends"] > 1e-2, r
