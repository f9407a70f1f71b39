"""The colocated PP>1 stage relay over NCCL (``stage_gather.relay_stage`` / ``receive_stage``): two
ranks on two GPUs swap their stages in pp order, each ending with the whole model on its own GPU, the
forwarding rank synchronizing after each bucket. What ``tests/distributed/test_stage_gather.py`` runs
over gloo; here the default group is NCCL, so every tensor and object moves in device memory. Needs two
GPUs: NCCL refuses two ranks on one."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]


def _stage(rank: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (f"model.layers.{rank}.w{i}", torch.randn(256, 128, generator=g).to(dtype))
        for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.bfloat16))
    ]


def _relay(rank: int) -> list:
    import itertools

    from megamarl.parallel.placement import WorkerGroupLayout
    from megamarl.rollout.weights.stage_gather import forward_device, receive_stage, relay_roles, relay_stage

    device = forward_device(on_gpu=True)
    role = relay_roles(WorkerGroupLayout([0, 1], pp=2), {0, 1})[rank]
    own = ((n, t.to(device)) for n, t in _stage(rank))
    named = relay_stage(own, destinations=role.destinations, bucket_bytes=100_000, device=device)
    stages = [named if s == role.stage else receive_stage(role.sources[s], device=device) for s in range(2)]
    return [(n, t.device.type, t.cpu()) for n, t in itertools.chain(*stages)]


def test_leaders_swap_stages_over_nccl_in_device_memory():
    if torch.cuda.device_count() < 2:  # without CUDA the tier's fixture has skipped already
        pytest.skip("NCCL point to point needs two CUDA devices (NCCL refuses two ranks on one)")
    expected = _stage(0) + _stage(1)
    for got in run_ranks(_relay, 2, timeout_s=300):
        assert [n for n, *_ in got] == [n for n, _ in expected]
        for (_, device, tensor), (_, want) in zip(got, expected):
            assert device == "cuda" and tensor.dtype == want.dtype and torch.equal(tensor, want)
