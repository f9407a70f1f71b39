"""Start-up of a GPU rank (world size 1, spawned like a torchrun child by ``run_ranks``):
``init_distributed`` binds the rank to its GPU and makes NCCL the default (device) group; the control
group is gloo (objects and barriers stay on the CPU); a worker group's groups are NCCL and its device
is the GPU; and none of ``megamarl.parallel.cpu_compat``'s CPU shims is in force, read from the
patched objects themselves (every shim has its probe), before and after ``enable_cpu_compat`` ran again,
so megatron-core runs unmodified; an in-process weight push receives on the GPU and sends its metadata
over gloo."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]


def _body(rank):
    import torch.distributed as dist

    from megamarl.parallel import cpu_compat
    from megamarl.parallel.distributed import control_group, local_device
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rollout.weights.weight_sync import push_transport

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    device = local_device()
    summed = torch.full((4,), 2.0, device=device)
    dist.all_reduce(summed)  # default group: NCCL on device tensors
    wg_summed = torch.ones(2, device=wg.device)
    dist.all_reduce(wg_summed, group=wg.pgs.dp)  # the WG's own (NCCL) group
    flag = torch.ones(1)
    dist.all_reduce(flag, group=control_group())  # gloo on a CPU tensor
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": rank}, group=control_group())
    return {
        "device": str(device),
        "current_device": torch.cuda.current_device(),
        "device_name": torch.cuda.get_device_name(),
        "default_backend": dist.get_backend(),
        "control_backend": dist.get_backend(control_group()),
        "wg_device": str(wg.device),
        "wg_backends": {axis: dist.get_backend(getattr(wg.pgs, axis)) for axis in ("tp", "pp", "dp")},
        "summed": summed.tolist(),
        "wg_summed": wg_summed.tolist(),
        "flag": flag.tolist(),
        "gathered": gathered,
        "patches_in_force": cpu_compat.patches_in_force(),
        "probes": sorted(cpu_compat._PROBES),
        "patches": sorted(cpu_compat.PATCHES),
        "compat_needed": cpu_compat.cpu_compat_needed(),
        # a second start-up on this rank must not switch the shims on: read from the patched objects after it
        "patches_after_enable": (cpu_compat.enable_cpu_compat(), cpu_compat.patches_in_force())[1],
        "push": (
            str(push_transport().device),
            dist.get_backend(push_transport().objects),
        ),  # in-process pushes
        "tensor_cuda": str(
            torch.zeros(1).cuda().device
        ),  # Tensor.cuda is torch's own (the shim keeps CPU tensors)
    }


def test_gpu_rank_starts_with_nccl_gloo_control_and_no_cpu_shims(record_property):
    (r,) = run_ranks(_body, 1)
    for key in (
        "device",
        "device_name",
        "default_backend",
        "control_backend",
        "wg_backends",
        "patches_in_force",
    ):
        record_property(key, r[key])
    assert r["device"] == "cuda:0" and r["current_device"] == 0 and r["wg_device"] == "cuda:0", r
    assert r["default_backend"] == "nccl" and r["control_backend"] == "gloo", r
    assert set(r["wg_backends"].values()) == {"nccl"}, r
    assert r["summed"] == [2.0] * 4 and r["wg_summed"] == [1.0, 1.0] and r["flag"] == [1.0], r
    assert r["gathered"] == [{"rank": 0}], r
    assert r["probes"] == r["patches"] and r["patches"], (
        r
    )  # every shim has a probe reading its patched object
    assert not r["compat_needed"] and r["patches_in_force"] == [] and r["patches_after_enable"] == [], r
    assert r["tensor_cuda"] == "cuda:0", r
    assert r["push"] == ("cuda:0", "gloo"), r  # receive buffers on the GPU (NCCL), bucket metadata over gloo
