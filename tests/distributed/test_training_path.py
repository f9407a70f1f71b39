"""The training path of issue 24 on 2 CPU ranks over gloo, through ``PolicyWorker`` itself:

- megatron-core's distributed optimizer (fp32 main params and Adam state sharded over DP=2) gives the
  same weights as its non-distributed optimizer, bit for bit, in fp32 and in bf16 parameters;
- ``mini_batch_size`` turns one policy batch into several optimizer steps (old log-probs once);
- ``recompute: selective|full`` leaves gradients unchanged;
- ``pack: true`` gives the padded path's loss and gradients (fp32) without padding;
- ``lr_schedule`` follows megatron-core's warmup + cosine formula, one increment per update.
"""

import math

import megatron_steps  # tests/ helper: gradients by HF name
import pytest
import torch
from test_policy_update import _batch, _loss_cfg

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _worker(name, wg, model_dir, **policy_keys):
    from megamarl.config import PolicyConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    dtype = policy_keys.pop("dtype", torch.float32)
    policy = PolicyConfig(
        model=str(model_dir), **{"micro_batch_size": 2, "lr": 1e-2, "grad_clip": 1.0, **policy_keys}
    )
    return PolicyWorker(
        name, policy, wg, load_policy_model(policy, wg, seed=0, dtype=dtype), _loss_cfg(), total_steps=4
    )


def _weights(worker) -> dict[str, torch.Tensor]:
    return {n: t.float().clone() for n, t in worker.export()}


def _optimizer_body(rank, model_dir):
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wg = build_worker_groups(PlacementConfig({"dp2": WorkerGroupLayout(ranks=[0, 1])}))["dp2"]
    batch = _batch()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        weights = {}
        for distributed in (False, True):
            worker = _worker("dp2", wg, model_dir, dtype=dtype, distributed_optimizer=distributed)
            out[f"{dtype}_{distributed}_type"] = type(worker.optimizer.chained_optimizers[0]).__name__
            out[f"{dtype}_{distributed}_param_dtype"] = str(next(worker.model.parameters()).dtype)
            norms = [worker.train_step(batch)["grad_norm"] for _ in range(2)]
            out[f"{dtype}_{distributed}_norms"] = norms
            weights[distributed] = _weights(worker)
            # Adam state held by this rank: sharded over DP with the distributed optimizer
            inner = worker.optimizer.chained_optimizers[0].optimizer
            out[f"{dtype}_{distributed}_state_numel"] = sum(
                s["exp_avg"].numel() for s in inner.state.values()
            )
        out[f"{dtype}_max_diff"] = max(
            (weights[True][n] - weights[False][n]).abs().max().item() for n in weights[True]
        )
    return out


def test_distributed_optimizer_equals_non_distributed(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_optimizer_body, 2, str(model_dir))
    for out in results:
        assert out["torch.float32_False_type"] == "FP32Optimizer"
        assert out["torch.float32_True_type"] == "DistributedOptimizer"
        assert out["torch.bfloat16_False_type"] == "Float16OptimizerWithFloat16Params"
        assert out["torch.bfloat16_True_param_dtype"] == "torch.bfloat16"
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert out[f"{dtype}_max_diff"] == 0.0, out  # bit-identical weights after two updates
            # the norm is a sum of fp32 per-tensor norms over other shards: equal to fp32 rounding
            assert out[f"{dtype}_True_norms"] == pytest.approx(out[f"{dtype}_False_norms"], rel=2e-4)
            # each DP rank holds about half of the Adam state (megatron-core pads its buffers)
            sharded, whole = out[f"{dtype}_True_state_numel"], out[f"{dtype}_False_state_numel"]
            assert 0.45 * whole <= sharded <= 0.55 * whole, (sharded, whole)
    total = results[0]["torch.float32_True_state_numel"] + results[1]["torch.float32_True_state_numel"]
    assert total >= results[0]["torch.float32_False_state_numel"]


def _features_body(rank, model_dir):
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import loss_counts

    wgs = build_worker_groups(
        PlacementConfig(
            {"tp2": WorkerGroupLayout(ranks=[0, 1], tp=2), "dp2": WorkerGroupLayout(ranks=[0, 1])}
        )
    )
    batch = _batch()
    out = {}
    # mini-batches: 5 rows in mini-batches of 2 -> 3 optimizer steps per epoch, 6 with two epochs
    worker = _worker("dp2", wgs["dp2"], model_dir, mini_batch_size=2, ppo_epochs=2)
    calls = []
    compute = worker.compute_logprobs
    worker.compute_logprobs = lambda part, **kw: (
        calls.append(kw.get("reference", False)) or compute(part, **kw)
    )
    metrics = worker.train_step(batch)
    out["mini_steps"], out["mini_updates"], out["old_calls"] = (
        metrics["optimizer_steps"],
        worker.num_updates,
        len(calls),
    )
    out["mini_sizes"] = [m.num_samples for m in worker.mini_batches(batch)]
    one = _worker("dp2", wgs["dp2"], model_dir, mini_batch_size=8)  # >= the batch: today's single step
    base = _worker("dp2", wgs["dp2"], model_dir)
    one.train_step(batch), base.train_step(batch)
    w_one, w_base = _weights(one), _weights(base)
    out["mini_whole_diff"] = max((w_one[n] - w_base[n]).abs().max().item() for n in w_one)

    # recompute and packing: the same gradients as the plain padded path (TP=2, fp32)
    counts = loss_counts(batch.response_mask)
    grads = {}
    for label, keys in {
        "none": {},
        "selective": {"recompute": "selective"},
        "full": {"recompute": "full"},
        "packed": {"pack": True, "max_tokens_per_micro_batch": 32, "micro_batch_size": 4},
    }.items():
        worker = _worker(label, wgs["tp2"], model_dir, distributed_optimizer=False, **keys)
        part = worker.my_part(batch)
        collected = worker.backward(part, worker.compute_logprobs(part), counts)
        grads[label] = dict(megatron_steps.export_hf_grads(worker.model, wgs["tp2"]))
        out[f"{label}_loss"] = sum(c["loss"] for c in collected)
        out[f"{label}_micro_batches"] = len(worker._micro_batches(part))
        out[f"{label}_padding"] = worker.padding_fraction(part)
    for label in ("selective", "full", "packed"):
        out[f"{label}_grad_diff"] = max(
            (grads[label][n] - grads["none"][n]).abs().max().item() for n in grads["none"]
        )
    out["grad_scale"] = max(g.abs().max().item() for g in grads["none"].values())

    # learning-rate schedule: 2 warmup updates, cosine to min_lr over 4 (megatron-core's formula)
    worker = _worker(
        "dp2", wgs["dp2"], model_dir, lr_schedule={"warmup_steps": 2, "decay": "cosine", "min_lr": 1e-3}
    )
    out["lrs"] = [worker.train_step(batch)["lr"] for _ in range(5)]
    return out


def test_mini_batches_recompute_packing_and_lr_schedule(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    for out in run_ranks(_features_body, 2, str(model_dir)):
        assert out["mini_sizes"] == [2, 2, 1]
        assert out["mini_steps"] == 6.0 and out["mini_updates"] == 6
        assert out["old_calls"] == 3  # one proximal-logprob pass per mini-batch, before any step
        assert out["mini_whole_diff"] == 0.0  # mini_batch_size >= batch: exactly the one-step update
        for label in ("selective", "full", "packed"):
            assert out[f"{label}_grad_diff"] <= 1e-5 * out["grad_scale"], (label, out)
            assert out[f"{label}_loss"] == pytest.approx(out["none_loss"], rel=1e-5, abs=1e-7)
        # 5 rows of lengths 9, 9, 9, 9, 9: padded micro-batches of 2 rows waste nothing here...
        assert out["none_padding"] == pytest.approx(0.0)
        assert out["packed_padding"] == 0.0
        assert out["packed_micro_batches"] == 2  # 32 tokens per micro-batch: 3 + 2 rows of 9 tokens
        lr, low = 1e-2, 1e-3
        expected = [0.0, lr / 2]  # warmup: lr * k / 2
        for k in (2, 3, 4):  # cosine over decay_steps=4 (trainer.total_steps), after the warmup
            ratio = (k - 2) / (4 - 2)
            expected.append(low + (lr - low) * 0.5 * (math.cos(math.pi * ratio) + 1.0))
        assert out["lrs"] == pytest.approx(expected, rel=1e-9), out["lrs"]


def _resume_body(rank, model_dir, ckpt):
    from megamarl.models import dist_checkpoint
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wg = build_worker_groups(PlacementConfig({"dp2": WorkerGroupLayout(ranks=[0, 1])}))["dp2"]
    batch = _batch()
    keys = {"mini_batch_size": 2, "lr_schedule": {"warmup_steps": 1, "decay": "linear"}}
    straight = _worker("dp2", wg, model_dir, **keys)
    for _ in range(2):
        straight.train_step(batch)
    dist_checkpoint.save_checkpoint(ckpt, straight.model, wg, optimizer=straight.optimizer)
    straight.train_step(batch)
    resumed = _worker("dp2", wg, model_dir, **keys)
    dist_checkpoint.load_checkpoint(ckpt, resumed.model, wg, optimizer=resumed.optimizer)
    resumed.scheduler.step(increment=2)  # the trainer restores the schedule's position (trainer.pt)
    resumed.train_step(batch)
    a, b = _weights(straight), _weights(resumed)
    steps = {float(s["step"]) for s in resumed.optimizer.chained_optimizers[0].optimizer.state.values()}
    return max((a[n] - b[n]).abs().max().item() for n in a), steps


def test_distributed_optimizer_checkpoint_resumes_exactly(tmp_path):
    """Sharded Adam state saved mid-run and loaded into a fresh worker: the next update is bit-identical
    (megatron-core 0.16 without TE/apex shared one step tensor between all parameters on load)."""
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    for diff, steps in run_ranks(_resume_body, 2, str(model_dir), str(tmp_path / "ckpt")):
        assert diff == 0.0
        assert steps == {9.0}  # 3 updates x 3 mini-batches, the same count on every parameter
