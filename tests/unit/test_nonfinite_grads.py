"""``optimizer.nonfinite`` / ``grads_nonfinite``: the per-step check of the gradient buffers before the
optimizer steps (one fp32 sum per buffer, a device flag; the skip itself: tests/distributed/
test_nonfinite_updates.py). Every kind of non-finite value is caught, in fp32 and bf16 buffers."""

from types import SimpleNamespace

import pytest
import torch

from megamarl.rl.optimizer import grads_nonfinite, nonfinite

CPU = torch.device("cpu")


def _ddp(*buffers: torch.Tensor):
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=b) for b in buffers])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bad", [[float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]]
)
def test_any_nan_or_infinity_in_any_buffer_is_caught(dtype, bad):
    clean = torch.randn(1000).to(dtype)
    dirty = torch.randn(1000).to(dtype)
    dirty[[17, 600][: len(bad)]] = torch.tensor(bad, dtype=dtype)
    flag = grads_nonfinite(_ddp(clean, dirty), device=CPU)
    assert flag.shape == () and flag.device == CPU and flag.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_buffers_pass(dtype):
    buffers = [
        torch.randn(1000).to(dtype) * 1e4,
        torch.zeros(7, dtype=dtype),
        torch.full((3,), 3e38).to(dtype)[:1],
    ]
    assert grads_nonfinite(_ddp(*buffers), device=CPU).item() == 0.0
    assert nonfinite([], device=CPU).item() == 0.0
