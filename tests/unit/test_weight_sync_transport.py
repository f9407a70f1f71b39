"""Where an in-process push's tensors travel (``weight_sync.push_transport``): on a GPU world the default
group is NCCL, which moves device tensors only, so the engine rank's receive buffers are made on its
own accelerator; the bucket metadata (pickled objects) goes over the gloo control group, never NCCL.
On a CPU world both are the CPU and the world group. CUDA is mocked (``torch.cuda.is_available``);
the process group is a real one-rank gloo world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamarl.parallel import distributed
from megamarl.parallel.placement import WorkerGroup, WorkerGroupLayout
from megamarl.rollout.weights import weight_sync


@pytest.fixture
def one_rank_world(monkeypatch):
    from megamarl.parallel.network import free_port

    monkeypatch.setattr(distributed, "_CONTROL_GROUP", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_cpu_world_pushes_cpu_tensors_and_objects_on_the_world_group(one_rank_world):
    via = weight_sync.push_transport()
    assert via.device == torch.device("cpu")
    assert via.objects is dist.group.WORLD


def test_nccl_world_receives_on_the_local_gpu_and_sends_objects_over_gloo(one_rank_world, monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: True
    )  # as on a GPU node: the default group is NCCL
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    via = weight_sync.push_transport()
    assert via.device == torch.device("cuda", 1)
    assert via.objects is distributed.control_group() and via.objects is not dist.group.WORLD
    assert dist.get_backend(via.objects) == "gloo"


class _RecordingEngine:
    def __init__(self):
        self.devices: list[str] = []

    def pause(self): ...
    def resume(self): ...
    def flush_cache(self): ...

    def update_weights(self, named, *, version, lora=None):
        self.devices += [str(t.device) for _, t in named]


def test_engine_rank_receives_into_the_chosen_device_over_the_chosen_group(monkeypatch):
    """``sync_weights`` on the engine rank of a WG it is not part of: every receive buffer is made on
    ``push_transport().device`` and every metadata message read from ``push_transport().objects``
    (the p2p calls are recorded; the meta device stands in for the GPU)."""
    objects_group = object()
    monkeypatch.setattr(
        weight_sync, "push_transport", lambda: weight_sync.PushTransport(torch.device("meta"), objects_group)
    )
    metas = [
        [("a", (2, 3), torch.float32), ("b", (4,), torch.float32)],
        [("c", (2,), torch.float32), ("d", (3,), torch.bfloat16)],
        None,
    ]
    seen = {"object_groups": [], "tensor_devices": []}

    def recv_object_list(holder, src=None, group=None, **_):
        seen["object_groups"].append(group)
        holder[0] = metas.pop(0)

    def recv(tensor, src=None, group=None, **_):
        seen["tensor_devices"].append(str(tensor.device))

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "recv_object_list", recv_object_list)
    monkeypatch.setattr(dist, "recv", recv)
    wg = WorkerGroup(
        "p", WorkerGroupLayout(ranks=[1])
    )  # rank 0 holds no shard: it receives stage 0 from rank 1
    engine = _RecordingEngine()
    stats = weight_sync.sync_weights(wg, None, [engine], version=1, engine_rank=0)
    assert stats.num_buckets == 2 and stats.num_tensors == 4
    assert seen["object_groups"] == [objects_group] * 3
    assert seen["tensor_devices"] == ["meta"] * 3  # one flat bucket, then two tensors of mixed dtypes
    assert engine.devices == ["meta"] * 4
