"""``VLLMNativeSender`` (vLLM's own nccl / ipc weight-transfer backends, GPU) on CPU: every HTTP body is
parsed by vLLM's own worker-side dataclasses in ``FakeVLLMServer``, and the replicas' weights really
change. Replaced here, because they need CUDA: the NCCL endpoint and broadcast (a queue per replica
instead) and the CUDA IPC handle (a key into a dict instead)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from megamarl.models.tiny import tiny_model
from megamarl.rollout import vllm_native_sync
from megamarl.rollout.base import SamplingParams
from megamarl.rollout.fakes import FakeVLLMServer, QueueTransport
from megamarl.rollout.hf import HFEngine
from megamarl.rollout.vllm_native_sync import VLLMNativeSender

PROMPT = [1, 9690, 198, 2683, 359]


def greedy(engine: HFEngine) -> tuple[list[int], int]:
    out = asyncio.run(engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8)))[0]
    return out.token_ids, out.weight_version


class _Broadcast:
    """Stands in for the NCCL group: one broadcast reaches every replica's queue."""

    def __init__(self, queues: list[QueueTransport]) -> None:
        self.queues, self.buckets, self.destroyed = queues, [], False

    def destroy(self) -> None:
        self.destroyed = True


@pytest.fixture
def nccl(monkeypatch):
    queues = [QueueTransport(), QueueTransport()]
    group = _Broadcast(queues)
    opened = []

    def open_nccl(addr, port, world_size):
        opened.append((addr, port, world_size))
        return group

    def broadcast(g, bucket, *, buffer_bytes, num_buffers):
        assert g is group and all(t.is_contiguous() for _, t in bucket)
        g.buckets.append([name for name, _ in bucket])
        for q in g.queues:
            q.send([t for _, t in bucket])

    monkeypatch.setattr(vllm_native_sync, "_open_nccl", open_nccl)
    monkeypatch.setattr(vllm_native_sync, "_broadcast_bucket", broadcast)
    return group, queues, opened


def test_nccl_push_reaches_every_replica_with_vllms_own_payloads(nccl):
    group, queues, opened = nccl
    servers = [FakeVLLMServer(HFEngine(tiny_model("llama", seed=0)), q, weight_transfer="nccl") for q in queues]
    reference = HFEngine(tiny_model("llama", seed=0))
    state = {k: v * 1.5 for k, v in tiny_model("llama", seed=0).state_dict().items()}
    reference.update_weights(list(state.items()), version=5)
    sender = VLLMNativeSender([s.url for s in servers], transport="nccl", master_port=29555, replica_tp=[1, 2],
                              dtype=torch.float32, buffer_bytes=1 << 20, num_buffers=2)
    try:
        sender.connect()
        assert opened == [("127.0.0.1", 29555, 4)]  # the sender and 1 + 2 workers
        infos = [s.init_info for s in servers]  # parsed by vLLM's NCCLWeightTransferInitInfo
        assert [i.rank_offset for i in infos] == [1, 2] and {i.world_size for i in infos} == {4}
        assert all(i.packed and i.packed_buffer_size_bytes == 1 << 20 and i.packed_num_buffers == 2 for i in infos)

        stats = sender.push(state.items(), version=5, bucket_bytes=64 * 1024, pause=True)
        assert stats.num_tensors == len(state) and stats.num_buckets == len(group.buckets) > 1
        assert stats.num_bytes == sum(t.numel() * 4 for t in state.values())
        for server in servers:
            paths = server.paths()
            updates = [i for i, p in enumerate(paths) if p == "/update_weights"]
            assert paths.index("/pause") < paths.index("/start_weight_update") < updates[0]
            assert updates[-1] < paths.index("/finish_weight_update") < paths.index("/reset_prefix_cache") \
                < paths.index("/resume")
            assert len(updates) == len(group.buckets)
            announced = [b["update_info"]["names"] for p, b in server.calls if p == "/update_weights"]
            assert announced == group.buckets  # each replica was told exactly what each broadcast carried
            assert greedy(server.engine) == greedy(reference)  # same tokens, version 5
    finally:
        sender.close()
        for server in servers:
            server.kill()
    assert group.destroyed


def test_nccl_sends_in_the_engines_dtype(nccl):
    group, queues, _ = nccl
    server = FakeVLLMServer(HFEngine(tiny_model("llama", seed=0)), queues[0], weight_transfer="nccl")
    group.queues = queues[:1]
    sender = VLLMNativeSender([server.url], transport="nccl", master_port=29556, dtype=torch.bfloat16)
    try:
        sender.connect()
        named = [("model.embed_tokens.weight", torch.randn(4, 3)), ("step", torch.tensor([7], dtype=torch.int64))]
        # the fake HF engine loads whatever arrives: check the announcement and the bytes, not the model
        body = []
        server.on_call = lambda path, b: body.append(b) if path == "/update_weights" else None
        server.engine.update_weights = lambda staged, version: None
        stats = sender.push(named, version=1, pause=False)
        assert body[0]["update_info"]["dtype_names"] == ["bfloat16", "int64"]
        assert stats.num_bytes == 4 * 3 * 2 + 8
    finally:
        sender.close()
        server.kill()


def test_ipc_push_hands_over_handles_keyed_by_gpu(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # set by server_launch for "ipc" servers
    shared: dict[int, torch.Tensor] = {}
    keys = itertools.count()

    def handles(tensor):
        key = next(keys)
        shared[key] = tensor
        return {"GPU-fake-0": (key,)}

    monkeypatch.setattr(vllm_native_sync, "_ipc_handles", handles)
    server = FakeVLLMServer(HFEngine(tiny_model("llama", seed=0)), weight_transfer="ipc", gpu_uuid="GPU-fake-0",
                            rebuild=lambda args: shared[args[0]].clone())
    reference = HFEngine(tiny_model("llama", seed=0))
    state = {k: v * 0.5 for k, v in tiny_model("llama", seed=0).state_dict().items()}
    reference.update_weights(list(state.items()), version=3)
    sender = VLLMNativeSender([server.url], transport="ipc")
    try:
        sender.connect()
        assert server.init_info.packed is False  # parsed by vLLM's IPCWeightTransferInitInfo
        sender.push(state.items(), version=3, bucket_bytes=64 * 1024, pause=False)
        bodies = [b["update_info"] for p, b in server.calls if p == "/update_weights"]
        assert len(bodies) > 1 and all("ipc_handles_pickled" in b and "ipc_handles" not in b for b in bodies)
        assert greedy(server.engine) == greedy(reference)
    finally:
        sender.close()
        server.kill()


def test_ipc_refuses_a_replica_wider_than_one_gpu():
    with pytest.raises(ValueError, match=r"transport='ipc'\) feeds replicas at engine TP=1"):
        VLLMNativeSender(["http://127.0.0.1:1"], transport="ipc", replica_tp=[2])
    with pytest.raises(ValueError, match=r"backend='nccl'\) needs master_port"):
        VLLMNativeSender(["http://127.0.0.1:1"], transport="nccl")
    with pytest.raises(ValueError, match="VLLMNativeSender backend 'gloo' unknown"):
        VLLMNativeSender(["http://127.0.0.1:1"], transport="gloo")
