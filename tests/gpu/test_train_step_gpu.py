"""One ``PolicyWorker.train_step`` of a tiny model on the GPU equals the same step on the CPU.

The same seeded model and batch go through the trainer's worker (megatron-core model, DDP, optimizer)
in a GPU rank and in a CPU rank (a child with ``CUDA_VISIBLE_DEVICES=""``: gloo and the CPU shims, as
on a machine without a GPU). Compared: the log-probs before the step, the loss and gradient norm of
the step, and the log-probs after it (so the optimizer's update is compared too).

- fp32 parameters: equal within fp32 kernel differences (``FP32_ATOL`` on log-probs).
- bf16 parameters (the GPU training dtype): "within bf16 tolerance", stated against the fp32 CPU
  result: the GPU's bf16 step may be at most ``BF16_FACTOR`` times as far from it as the CPU's own
  bf16 step is (plus ``BF16_ATOL``), so the bound is set by bf16 rounding, measured in the same run.
"""

import pytest
import torch
from gpu_common import make_batch, make_worker, one_rank_wg

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

FP32_ATOL = 1e-3  # log-probs (magnitudes up to ~20 with this peaked tiny model)
FP32_RTOL = 1e-3  # loss, gradient norm
BF16_FACTOR = 3.0
BF16_ATOL = 0.02


def _step_body(rank, model_dir):
    batch = make_batch(0)
    wg = one_rank_wg()
    out = {"device": str(wg.device)}
    for dtype in (torch.float32, torch.bfloat16):
        worker = make_worker(model_dir, wg, dtype=dtype, distributed_optimizer=False)
        before = worker.compute_logprobs(batch).float().cpu()
        metrics = worker.train_step(batch)
        after = worker.compute_logprobs(batch).float().cpu()
        out[str(dtype)] = {
            "before": before,
            "after": after,
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "skipped": metrics["nonfinite_skipped"],
            "param_device": str(next(worker.model.parameters()).device),
        }
    # after megamarl (and megatron-core under it) built and stepped both workers: torch's default is off,
    # so only something megamarl set would turn it on
    out["tf32"] = {
        "matmul": torch.backends.cuda.matmul.allow_tf32,
        "precision": torch.get_float32_matmul_precision(),
    }
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_train_step_on_cuda_equals_the_cpu_step(tiny_llama, monkeypatch, record_property):
    (gpu,) = run_ranks(_step_body, 1, tiny_llama)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the child sees no GPU: the CPU path, shims and all
    (cpu,) = run_ranks(_step_body, 1, tiny_llama)
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu", (gpu["device"], cpu["device"])
    assert gpu["tf32"] == {"matmul": False, "precision": "highest"}, (
        f"TF32 matmuls are on after the steps: {gpu['tf32']}"
    )
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    assert gpu[fp32]["param_device"].startswith("cuda") and cpu[fp32]["param_device"] == "cpu"
    for run in (gpu, cpu):
        assert run[fp32]["skipped"] == 0.0 and run[bf16]["skipped"] == 0.0
    mask = make_batch(0).response_mask

    # fp32: the same numbers up to kernel differences
    g, c = gpu[fp32], cpu[fp32]
    figures = {
        "fp32_before": _max_diff(g["before"], c["before"]),
        "fp32_after": _max_diff(g["after"], c["after"]),
    }
    assert g["after"][mask].ne(g["before"][mask]).any(), "the step changed nothing"
    assert figures["fp32_before"] <= FP32_ATOL and figures["fp32_after"] <= FP32_ATOL, figures
    assert g["loss"] == pytest.approx(c["loss"], rel=FP32_RTOL, abs=1e-6)
    assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=FP32_RTOL)

    # bf16: as close to the fp32 CPU result as bf16 rounding puts the CPU's own bf16 step
    for when in ("before", "after"):
        gpu_err = _max_diff(gpu[bf16][when], c[when])
        cpu_err = _max_diff(cpu[bf16][when], c[when])
        figures[f"bf16_{when}_gpu_vs_fp32"], figures[f"bf16_{when}_cpu_vs_fp32"] = gpu_err, cpu_err
        assert gpu_err <= BF16_FACTOR * cpu_err + BF16_ATOL, (when, figures)
    for key in ("loss", "grad_norm"):
        gpu_err, cpu_err = abs(gpu[bf16][key] - c[key]), abs(cpu[bf16][key] - c[key])
        figures[f"bf16_{key}_gpu_vs_fp32"], figures[f"bf16_{key}_cpu_vs_fp32"] = gpu_err, cpu_err
        assert gpu_err <= BF16_FACTOR * cpu_err + BF16_ATOL * abs(c[key]), (key, figures)
    for key, value in figures.items():
        record_property(key, round(value, 6))
    print("\nmax |difference| of log-probs / loss / grad norm:", {k: f"{v:.2e}" for k, v in figures.items()})
