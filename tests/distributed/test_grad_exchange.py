"""On gloo (CPU) the distributed optimizer's gradients are all-reduced in place instead of
reduce-scattered (``rl.worker_parts.finalize_grads_on_trimmed_heap``): gloo's ``reduce_scatter_tensor``
copies the whole fp32 gradient buffer first. The update is bit-identical to megatron-core's
reduce-scatter: two DP=2 workers from the same weights, one per exchange, take one step on the same
batch and end with equal weights and equal loss and gradient norm."""

from __future__ import annotations

import functools

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _one_update_each_way(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker
    from megamarl.rl.worker_parts import finalize_grads_on_trimmed_heap
    from tests.distributed.test_optimizer_checkpoint import _batch

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0, 1])}))["p"]
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=1, lr=1e-2, distributed_optimizer=True)
    out = {}
    for in_place in (True, False):
        worker = PolicyWorker(
            "p", policy, wg, load_policy_model(policy, wg, seed=0, dtype=torch.float32), LossConfig()
        )
        config = worker.model.config
        assert config.finalize_model_grads_func.keywords == {"in_place": True}  # what a CPU worker uses
        config.finalize_model_grads_func = functools.partial(
            finalize_grads_on_trimmed_heap, in_place=in_place
        )
        metrics = worker.train_step(_batch())
        out[in_place] = {
            "metrics": {k: v for k, v in metrics.items() if "loss" in k or "grad_norm" in k},
            "weights": {n: p.detach().clone() for n, p in worker.model.named_parameters()},
        }
    return out


def test_in_place_all_reduce_updates_exactly_like_the_reduce_scatter(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    for result in run_ranks(_one_update_each_way, 2, str(model_dir)):
        in_place, scattered = result[True], result[False]
        assert in_place["metrics"] and in_place["metrics"] == scattered["metrics"]
        assert in_place["weights"].keys() == scattered["weights"].keys()
        for name, weight in in_place["weights"].items():
            assert torch.equal(weight, scattered["weights"][name]), name
