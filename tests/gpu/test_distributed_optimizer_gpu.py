"""megatron-core's distributed optimizer steps on the GPU (``policies.<p>.distributed_optimizer``).

Two updates of the same worker with megatron-core's ``DistributedOptimizer`` (fp32 main parameters and
Adam moments in shards of the DDP buffer; one rank here, so one shard) and with its non-distributed
optimizer (``Float16OptimizerWithFloat16Params`` for bf16, ``FP32Optimizer`` for fp32): the optimizer
state lives on the GPU, the updates are finite and move the weights, and both optimizers give the same
weights (fp32 to ``FP32_ATOL``; bf16 to one rounding step of the bf16 copy: the main parameters agree
to fp32 rounding, their bf16 copies may land on either side of a rounding boundary)."""

import pytest
import torch
from gpu_common import make_batch, make_worker, max_abs_diff, one_rank_wg, weights

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

FP32_ATOL = 1e-6
LR = 1e-2  # updates well above bf16 resolution (weights ~0.15, one bf16 step ~6e-4)


def _body(rank, model_dir):
    from megamarl.rl.offload import main_params, torch_optimizers

    batch = make_batch(3)
    wg = one_rank_wg()
    out = {"device": str(wg.device)}
    for dtype in (torch.float32, torch.bfloat16):
        for distributed in (False, True):
            worker = make_worker(model_dir, wg, dtype=dtype, lr=LR, distributed_optimizer=distributed)
            initial = weights(worker)
            metrics = [worker.train_step(batch) for _ in range(2)]
            inner = torch_optimizers([worker.optimizer])
            key = (str(dtype), distributed)
            out[key] = {
                "type": type(worker.optimizer.chained_optimizers[0]).__name__,
                "skipped": [m["nonfinite_skipped"] for m in metrics],
                "grad_norms": [m["grad_norm"] for m in metrics],
                "main_devices": sorted({str(p.device) for opt in inner for p in main_params(opt)}),
                "main_dtypes": sorted({str(p.dtype) for opt in inner for p in main_params(opt)}),
                "state_devices": sorted(
                    {
                        str(v.device)
                        for opt in inner
                        for s in opt.state.values()
                        for k, v in s.items()
                        if isinstance(v, torch.Tensor) and k != "step"
                    }
                ),
                "weights": weights(worker),
                "moved": max_abs_diff(weights(worker), initial),
            }
    return out


def test_distributed_optimizer_steps_on_cuda_like_the_plain_one(tiny_llama, record_property):
    (r,) = run_ranks(_body, 1, tiny_llama)
    assert r["device"].startswith("cuda"), r["device"]
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    assert r[(fp32, True)]["type"] == r[(bf16, True)]["type"] == "DistributedOptimizer"
    assert r[(fp32, False)]["type"] == "FP32Optimizer"
    assert r[(bf16, False)]["type"] == "Float16OptimizerWithFloat16Params"
    for key, got in r.items():
        if key == "device":
            continue
        assert got["skipped"] == [0.0, 0.0] and got["moved"] >= 0.5 * LR, (key, got["skipped"], got["moved"])
        assert got["main_devices"] == ["cuda:0"] and got["state_devices"] == ["cuda:0"], (key, got)
        assert got["main_dtypes"] == ["torch.float32"], (key, got["main_dtypes"])  # fp32 main params / Adam
    fp32_diff = max_abs_diff(r[(fp32, True)]["weights"], r[(fp32, False)]["weights"])
    assert fp32_diff <= FP32_ATOL, fp32_diff
    dist_w, plain_w = r[(bf16, True)]["weights"], r[(bf16, False)]["weights"]
    bf16_diff = max_abs_diff(dist_w, plain_w)
    one_step = max(w.abs().max().item() for w in plain_w.values()) * 2.0**-7  # bf16: 8 significant bits
    differing = sum((dist_w[n] != plain_w[n]).sum().item() for n in plain_w) / sum(
        w.numel() for w in plain_w.values()
    )
    for name, value in (
        ("fp32_weight_diff", fp32_diff),
        ("bf16_weight_diff", bf16_diff),
        ("bf16_fraction_differing", differing),
    ):
        record_property(name, value)
    print(
        f"\ndistributed vs plain optimizer after 2 updates: fp32 max diff {fp32_diff:.2e}, bf16 max diff "
        f"{bf16_diff:.2e} (one bf16 step at the largest weight {one_step:.2e}), {differing:.2%} of bf16 "
        "weights differ"
    )
    assert bf16_diff <= one_step and differing <= 0.01, (bf16_diff, one_step, differing)
    for dtype in (fp32, bf16):
        assert r[(dtype, True)]["grad_norms"] == pytest.approx(r[(dtype, False)]["grad_norms"], rel=1e-3)
