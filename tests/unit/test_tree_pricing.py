"""The dry-run prices a ``prefix_tree`` micro-batch by its layout (``planning.memory.tree_attention_cost``):
flex attention on GPUs (no ``[N, N]`` mask or scores: the block mask, the logsumexp and flex's own
output copy), the local spec's dense mask on CPU ranks (the ``[N, N]`` mask and the fp32 scores
``[heads/tp, N, N]`` of every layer), and in both the output layer and log-prob peak on its ``K``
prediction rows, which the node budget does not bound. Exact bytes, through the user-facing dry-run
(``cli.dry_run_command.main_dry_run``: ``scripts/train.py --config ... --dry-run``)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from megamarl.cli.configure import load_config
from megamarl.cli.dry_run_command import main_dry_run
from megamarl.models.tree_attention import block_mask_bytes
from megamarl.planning.dryrun import plan_memory, training_setup, tree_line
from megamarl.planning.memory import TrainingSetup, activation_bytes, tree_attention_cost
from megamarl.planning.model_presets import resolve_model_shape

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "70b_hetero.yaml"
# the executor (llama3-8b, tp 2, pp 1, bf16): 4 rows of 4096 tokens, packed into 4096-token micro-batches
PACKED = [
    "policies.executor.micro_batch_size=4",
    "policies.executor.pack=true",
    "policies.executor.max_tokens_per_micro_batch=4096",
]
TREE = PACKED + ["policies.executor.prefix_tree=true"]
N, K = 4096, 4 * 4096  # nodes per micro-batch (the budget); prediction rows (4 rows x seq_len)


def _dry_run(overrides):
    out = io.StringIO()
    cfg = load_config(CONFIG, overrides)
    assert main_dry_run(cfg, console=Console(file=out, width=400)) == 0
    return cfg, out.getvalue()


def test_the_dry_run_prices_flex_tree_attention_on_gpus():
    cfg, text = _dry_run(TREE)
    assert training_setup(cfg, "executor", on_gpus=True).tree_attention == "flex"
    line = (
        "policies.executor.prefix_tree: 4,096 nodes per micro-batch, flex attention: block mask 0.05 MiB "
        "(49,664 B), no [N, N] mask or scores; output layer on up to 16,384 prediction rows"
    )
    assert line in text
    assert block_mask_bytes(N) == 8 * 4096 + 16 * (32 + 32**2) == 49_664
    packed_cfg, packed_text = _dry_run(PACKED)
    assert "prefix_tree" not in packed_text
    plans = [
        plan_memory(c, world_size=64, gpus_per_node=8, on_gpus=True, overlaps_training=False)
        for c in (packed_cfg, cfg)
    ]
    packed, tree = (p.worker_groups["executor"].stages[0].activations for p in plans)
    b, h, tp, layers = 2, 4096, 2, 32
    q_t, vocab = 32 * 128 // tp, 128256 // tp
    extra = (
        layers * b * q_t * N  # flex keeps its output and the projection its copy (TE: one tensor)
        + block_mask_bytes(N)  # no [N, N] tensor: the block mask, once per micro-batch
        + b * h * (K - N)  # the output layer's input on K rows
        + (b + 24) * (K - N) * vocab  # the log-prob peak on K rows
    )
    assert tree - packed == extra, (tree - packed, extra)
    assert (packed, tree) == (22_609_444_864, 43_735_155_200), (packed, tree)


def test_the_dense_mask_tree_is_priced_with_its_n_squared_terms():
    cfg = load_config(CONFIG, TREE)
    shape = resolve_model_shape("llama3-8b", key="policies.executor.model")
    policy, layout = (
        cfg.policies["executor"],
        plan_memory(cfg, world_size=64, gpus_per_node=8, on_gpus=True, overlaps_training=False)
        .worker_groups["executor"]
        .layout,
    )
    mask = TrainingSetup(dtype="bf16", micro_batch_size=4, spec="local", tree_attention="mask")
    flex = TrainingSetup(dtype="bf16", micro_batch_size=4, spec="local", tree_attention="flex")
    cost = tree_attention_cost(shape, policy, layout, mask)
    assert cost is not None
    heads = 32 / 2
    assert (cost.nodes, cost.prediction_rows, cost.mask_bytes) == (N, K, N * N)
    assert cost.scores_bytes_per_layer == (4 + 2) * heads * N * N == 1_610_612_736  # fp32 + bf16 probs
    assert tree_line("executor", cost) == (
        "policies.executor.prefix_tree: 4,096 nodes per micro-batch, dense mask: [N, N] mask 16.00 MiB "
        "(16,777,216 B), attention scores 1,536.00 MiB (1,610,612,736 B) per layer; output layer on up to "
        "16,384 prediction rows"
    )
    dense, sparse = (activation_bytes(shape, policy, layout, s, stage=0) for s in (mask, flex))
    # the same local spec: flex drops the scores and the mask, adds the logsumexp, its output copy and
    # the block mask; the local spec's attention keeps k and v expanded to every head (3 b q_t)
    b, q_t, kv_t = 2, 32 * 128 / 2, 8 * 128 / 2
    per_token = (3 * b * q_t + (4 + b) * heads * N + b * q_t) - (
        b * (q_t + kv_t) + b * (q_t + 2 * kv_t) + 2 * b * q_t + 4 * heads
    )
    assert dense - sparse == 32 * per_token * N + N * N - block_mask_bytes(N)
