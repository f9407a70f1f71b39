"""Flex tree attention (``models.tree_attention``) through ``PolicyWorker`` on 2 CPU ranks over gloo: at
TP=2 (each rank its half of the heads, GQA groups split) and PP=2 (the subtree ends reach every stage's
layers as their attention-mask argument) the flex tree update equals the unshared packed update in fp32
(log-probs 1e-5 absolute, gradients 1e-5 of the largest), on ``test_tree_update``'s batch of shared
prompts, turns and instructions. On CPU the product builds the dense-mask path; here the node says CUDA
(``NodeKernels``: the layer spec stays local, no fused kernels), which is what builds flex, and flex's
backward runs eagerly with torch's CPU refusal lifted (``tests/flex_cpu.py``).
"""

import dataclasses

import megatron_steps  # tests/ helper: gradients by HF name
import pytest
from test_tree_update import _tree_batch

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:flex_attention called without")]


def _body(rank, model_dir):
    from flex_cpu import flex_backward_on_cpu
    from test_policy_update import _loss_cfg

    from megamarl.config import PolicyConfig
    from megamarl.models.bridge import unwrap
    from megamarl.models.spec import NodeKernels
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import loss_counts
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    cpu = NodeKernels(
        cuda=False,
        transformer_engine=False,
        wgrad_fusion=False,
        softmax_fusion=False,
        rope_fusion=False,
        triton=False,
    )
    wgs = build_worker_groups(
        PlacementConfig(
            {"tp2": WorkerGroupLayout(ranks=[0, 1], tp=2), "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2)}
        )
    )
    batch = _tree_batch()
    counts = loss_counts(batch.response_mask)
    out = {}
    for layout, wg in wgs.items():
        lps, grads = {}, {}
        for tree in (False, True):
            policy = PolicyConfig(
                model=model_dir,
                micro_batch_size=8,
                lr=1e-3,
                grad_clip=0.0,
                distributed_optimizer=False,
                pack=True,
                prefix_tree=tree,
            )
            node = dataclasses.replace(cpu, cuda=tree)  # "CUDA": flex tree attention
            handle = load_policy_model(policy, wg, seed=0, node=node)
            worker = PolicyWorker(layout, policy, wg, handle, _loss_cfg(), total_steps=2)
            out[f"{layout}_{tree}_attention"] = unwrap(worker.model).tree_attention
            part = worker.my_part(batch)
            with flex_backward_on_cpu():
                lps[tree] = worker.compute_logprobs(part)
                worker.backward(part, lps[tree], counts)
            grads[tree] = dict(megatron_steps.export_hf_grads(worker.model, wg))
        if wg.is_last_stage:
            out[f"{layout}_logprobs"] = (lps[True] - lps[False]).abs().max().item()
        out[f"{layout}_grads"] = max(
            (grads[True][n] - grads[False][n]).abs().max().item() for n in grads[False]
        )
        out[f"{layout}_scale"] = max(g.abs().max().item() for g in grads[False].values())
    return out


def test_flex_tree_update_equals_the_packed_update_at_tp2_and_pp2(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_body, 2, str(model_dir), timeout_s=600)
    for r in results:
        for layout in ("tp2", "pp2"):
            assert (r[f"{layout}_False_attention"], r[f"{layout}_True_attention"]) == (None, "flex"), r
            assert r[f"{layout}_grads"] <= 1e-5 * r[f"{layout}_scale"] and r[f"{layout}_scale"] > 0, (
                layout,
                r,
            )
        assert r["tp2_logprobs"] <= 1e-5, r
    assert any("pp2_logprobs" in r and r["pp2_logprobs"] <= 1e-5 for r in results), results
    print({k: v for k, v in results[0].items() if not k.endswith("attention")})
