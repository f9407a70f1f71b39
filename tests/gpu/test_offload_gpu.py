"""``offload_train_state`` on a GPU (needs CUDA; skipped elsewhere): a worker group's weights,
gradient buffers and optimizer state leave the GPU between updates and come back unchanged.

Two identical workers (fp32, megatron-core's distributed optimizer: the parameters are views of DDP's
``param_data`` buffer) take two updates each on the same batches; one offloads and restores its
training state between them. Offloaded, every parameter's storage is empty on the GPU and at least
3/4 of the bytes it moved to host memory are free on the GPU (it frees the gradient buffers too);
restored, the twins' weights stay bit-identical after one more update."""

import pytest
import torch
from gpu_common import make_batch, make_worker, one_rank_wg

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]


def _body(rank, model_dir):
    wg = one_rank_wg()
    plain, offloading = (make_worker(model_dir, wg) for _ in range(2))
    plain.train_step(make_batch(0))
    offloading.train_step(make_batch(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stats = offloading.train_state.offload()
    freed = before - torch.cuda.memory_allocated()
    emptied = all(p.untyped_storage().nbytes() == 0 for p in offloading.model.parameters())
    offloading.train_state.restore()
    plain.train_step(make_batch(1))
    offloading.train_step(make_batch(1))
    same = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), offloading.model.parameters()))
    held = sum(p.numel() * p.element_size() for p in offloading.model.parameters())
    return {
        "device": str(wg.device),
        "moved": stats.num_bytes,
        "freed": freed,
        "held": held,
        "emptied": emptied,
        "same": same,
    }


def test_offload_frees_the_gpu_and_restores_the_exact_state(tiny_llama, record_property):
    (r,) = run_ranks(_body, 1, tiny_llama)
    for key in ("moved", "freed", "held"):
        record_property(key, r[key])
    print(
        f"\noffload: {r['moved']} bytes to host, {r['freed']} freed on the GPU "
        f"({r['freed'] / r['moved']:.1%}); "
        f"weights {r['held']} bytes; identical after restore and one more update: {r['same']}"
    )
    assert r["device"].startswith("cuda"), r
    assert r["emptied"] and r["same"], r
    # weights + fp32 grad buffer + two Adam moments: at least weights + moments leave the GPU
    assert r["moved"] >= 3 * r["held"] * 0.99 and r["freed"] >= 0.75 * r["moved"], r
