"""Activation recomputation on the GPU leaves the gradients unchanged.

``policies.<p>.recompute`` (``none`` / ``selective``: core attention / ``full``: every layer rebuilt
from its input) only trades memory for compute: the same worker backward (``PolicyWorker.backward``:
the policy loss through megatron-core's schedule into the DDP fp32 gradient buffers) must give the
same loss and gradients. fp32 within ``FP32_RTOL`` of the largest gradient (kernel nondeterminism
only), bf16 parameters within ``BF16_RTOL`` (the recomputed forward runs the same bf16 kernels). Equal
gradients alone would also pass if the key were ignored, so the test also counts what the forward keeps
for backward (autograd's saved storages, parameters aside, outside backward's own recomputation): core
every layer recomputed keeps less than nothing or core attention recomputed."""

from functools import partial

import megatron_steps  # tests/ helper: gradients by HF name
import pytest
import torch
from gpu_common import make_batch, make_worker, one_rank_wg
from saved_storage import record_saved_storage  # tests/ helper

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

MODES = ("none", "selective", "full")
FP32_RTOL = 1e-5
BF16_RTOL = 1e-2


def _forward_saved(params: set[int], storages: dict[int, int], tensor: torch.Tensor) -> torch.Tensor:
    """What the forward keeps for backward; backward's recomputation (a graph task runs) is not counted."""
    if torch._C._current_graph_task_id() == -1:
        record_saved_storage(params, storages, tensor)
    return tensor


def _body(rank, model_dir):
    from megamarl.rl.losses import loss_counts

    batch = make_batch(2)
    wg = one_rank_wg()
    counts = loss_counts(batch.response_mask)
    out = {"device": str(wg.device)}
    for dtype in (torch.float32, torch.bfloat16):
        for mode in MODES:
            worker = make_worker(model_dir, wg, dtype=dtype, recompute=mode, distributed_optimizer=False)
            part = worker.my_part(batch)
            old_logprobs = worker.compute_logprobs(part)
            params = {q.untyped_storage().data_ptr() for q in worker.model.parameters()}
            storages: dict[int, int] = {}
            with torch.autograd.graph.saved_tensors_hooks(
                partial(_forward_saved, params, storages), lambda t: t
            ):
                collected = worker.backward(part, old_logprobs, counts)
            grads = {n: g.float().cpu() for n, g in megatron_steps.export_hf_grads(worker.model, wg)}
            out[(str(dtype), mode)] = {
                "loss": sum(c["loss"] for c in collected),
                "grads": grads,
                "recompute": worker.model.config.recompute_granularity,
                "saved_bytes": sum(storages.values()),
            }
            del worker
            torch.cuda.empty_cache()
    return out


def test_recompute_none_selective_full_give_equal_gradients(tiny_llama, record_property):
    (r,) = run_ranks(_body, 1, tiny_llama)
    assert r["device"].startswith("cuda"), r["device"]
    for dtype, rtol in ((str(torch.float32), FP32_RTOL), (str(torch.bfloat16), BF16_RTOL)):
        plain = r[(dtype, "none")]
        scale = max(g.abs().max().item() for g in plain["grads"].values())
        assert plain["recompute"] is None and scale > 0
        saved = [r[(dtype, mode)]["saved_bytes"] for mode in MODES]
        record_property(f"{dtype}_saved_bytes_none_selective_full", saved)
        # full keeps only each layer's input; selective's saving (the attention probabilities) is below its
        # checkpoint's own inputs at these tiny lengths (CPU run of this body: fp32 1191458 / 1115153 /
        # 493274,
        # bf16 803441 / 809470 / 461810 bytes), so only its granularity is checked
        assert 0 < saved[2] < min(saved[0], saved[1]), (
            f"{dtype}: full recompute does not cut what the forward keeps: {saved}"
        )
        for mode in ("selective", "full"):
            got = r[(dtype, mode)]
            assert got["recompute"] == mode, got["recompute"]
            diff = max((got["grads"][n] - g).abs().max().item() for n, g in plain["grads"].items())
            record_property(f"{dtype}_{mode}_grad_diff_over_scale", diff / scale)
            print(f"\n{dtype} recompute={mode}: max |grad diff| {diff:.3e} (largest grad {scale:.3e})")
            assert diff <= rtol * scale, (dtype, mode, diff, scale)
            assert got["loss"] == pytest.approx(plain["loss"], rel=rtol, abs=1e-7), (dtype, mode)
