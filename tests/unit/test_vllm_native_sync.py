"""``VLLMNativeSender`` (vLLM's own nccl / ipc weight-transfer backends, GPU) on CPU: every HTTP body is
parsed by vLLM's own worker-side dataclasses in ``FakeVLLMServer``, and the replicas' weights really
change. Replaced here, because they need CUDA: the NCCL endpoint and broadcast (a queue per replica
instead) and the CUDA IPC handle (a key into a dict instead)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from fake_servers import FakeVLLMServer, QueueTransport  # tests/ helper

from megamarl.models.tiny import tiny_model
from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.hf import HFEngine
from megamarl.rollout.weights import vllm_native_sync
from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender

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
    servers = [
        FakeVLLMServer(HFEngine(tiny_model("llama", seed=0)), q, weight_transfer="nccl") for q in queues
    ]
    reference = HFEngine(tiny_model("llama", seed=0))
    state = {k: v * 1.5 for k, v in tiny_model("llama", seed=0).state_dict().items()}
    reference.update_weights(list(state.items()), version=5)
    sender = VLLMNativeSender(
        [s.url for s in servers],
        transport="nccl",
        master_port=29555,
        replica_tp=[1, 2],
        dtype=torch.float32,
        buffer_bytes=1 << 20,
        num_buffers=2,
    )
    try:
        sender.connect()
        assert opened == [("127.0.0.1", 29555, 4)]  # the sender and 1 + 2 workers
        infos = [s.init_info for s in servers]  # parsed by vLLM's NCCLWeightTransferInitInfo
        assert [i.rank_offset for i in infos] == [1, 2] and {i.world_size for i in infos} == {4}
        assert all(
            i.packed and i.packed_buffer_size_bytes == 1 << 20 and i.packed_num_buffers == 2 for i in infos
        )

        stats = sender.push(state.items(), version=5, bucket_bytes=64 * 1024, pause=True)
        assert stats.num_tensors == len(state) and stats.num_buckets == len(group.buckets) > 1
        assert stats.num_bytes == sum(t.numel() * 4 for t in state.values())
        for server in servers:
            paths = server.paths()
            updates = [i for i, p in enumerate(paths) if p == "/update_weights"]
            assert paths.index("/pause") < paths.index("/start_weight_update") < updates[0]
            assert (
                updates[-1]
                < paths.index("/finish_weight_update")
                < paths.index("/reset_prefix_cache")
                < paths.index("/resume")
            )
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
        named = [
            ("model.embed_tokens.weight", torch.randn(4, 3)),
            ("step", torch.tensor([7], dtype=torch.int64)),
        ]
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
    server = FakeVLLMServer(
        HFEngine(tiny_model("llama", seed=0)),
        weight_transfer="ipc",
        gpu_uuid="GPU-fake-0",
        rebuild=lambda args: shared[args[0]].clone(),
    )
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


# -- stream ordering: the packed producer waits for the cast ------------------------------------------


class _Timeline:
    """Fake CUDA streams and events that log, in program order, what each stream was given:
    ``(stream, op, what)`` with op cast | record | wait | pack | broadcast | sync."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, object]] = []
        self.streams = [_FakeStream(self, "main")]  # the current-stream stack
        self.num_streams = self.num_events = 0

    @property
    def current(self) -> _FakeStream:
        return self.streams[-1]

    def add(self, op: str, what: object) -> None:
        self.log.append((self.current.name, op, what))

    def unordered_packs(self) -> list[tuple[str, object]]:
        """Packs whose stream had not waited for an event recorded on the casting stream after the
        cast of every tensor in the pack (a pack could read bytes the cast has not written yet)."""
        bad = []
        for i, (stream, op, names) in enumerate(self.log):
            if op != "pack":
                continue
            waited = {what for s, o, what in self.log[:i] if s == stream and o == "wait"}
            recorded = [j for j, (s, o, what) in enumerate(self.log[:i]) if o == "record" and what in waited]
            casts = [j for j, (s, o, what) in enumerate(self.log) if o == "cast" and what in names]
            if not recorded or not casts or max(recorded) < max(casts):
                bad.append((stream, names))
        return bad


class _FakeStream:
    def __init__(self, timeline: _Timeline, name: str | None = None, device=None) -> None:
        if name is None:
            timeline.num_streams += 1
            name = f"pack{timeline.num_streams}"
        self.timeline, self.name = timeline, name

    def synchronize(self) -> None:
        self.timeline.log.append((self.name, "sync", None))

    def wait_event(self, event) -> None:
        self.timeline.log.append((self.name, "wait", event.id))


@pytest.fixture
def timeline(monkeypatch):
    """torch.cuda's stream and event calls replaced by ``_Timeline`` fakes; vLLM's real producer
    (``packed_nccl_broadcast_producer``) runs over them, its ``pack_tensors`` logged."""
    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    line = _Timeline()

    class Event:
        def __init__(self, *args, **kwargs) -> None:
            line.num_events += 1
            self.id = f"event{line.num_events}"

        def record(self, stream=None) -> None:
            (stream or line.current).timeline.log.append(((stream or line.current).name, "record", self.id))

    class StreamContext:
        def __init__(self, stream) -> None:
            self.stream = stream

        def __enter__(self):
            line.streams.append(self.stream)

        def __exit__(self, *exc) -> None:
            line.streams.pop()

    real_pack = packed_tensor.pack_tensors

    def pack(iterator, post_iter_func, buffer_size_bytes, *args, **kwargs):
        chunk = real_pack(iterator, post_iter_func, buffer_size_bytes, *args, **kwargs)
        if chunk is not None:
            line.add("pack", tuple(chunk.names))
        return chunk

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(line, device=device))
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: line.current)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(packed_tensor, "pack_tensors", pack)
    packed_tensor._get_streams.cache_clear()  # cached per device: fake streams must not outlive the test
    yield line, packed_tensor
    packed_tensor._get_streams.cache_clear()


class _Group:
    """vLLM's PyNcclCommunicator as the producer calls it: ``broadcast(tensor, src)``."""

    def __init__(self, line: _Timeline) -> None:
        self.line, self.sent = line, []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.line.add("broadcast", tensor.numel())
        self.sent.append(tensor.clone())


class _Client:
    def __init__(self) -> None:
        self.bodies = []

    def post(self, path, payload=None, *, query=None, timeout_s=None):
        self.bodies.append((path, payload))
        return {}

    def close(self) -> None:
        pass


def test_packing_streams_wait_for_the_cast(timeline, monkeypatch):
    """``VLLMNativeSender.send`` casts each bucket on the current stream and hands it to vLLM's packed
    producer, which packs on streams of its own: every pack comes after a wait on an event recorded
    after the casts, and the bytes broadcast are the cast tensors."""
    line, _ = timeline
    real_wire = VLLMNativeSender._wire

    def wire(self, tensor):
        line.add("cast", names[id(tensor)])
        return real_wire(self, tensor)

    monkeypatch.setattr(VLLMNativeSender, "_wire", wire)
    named = [(f"layer{i}.weight", torch.randn(64, 32)) for i in range(5)] + [("step", torch.tensor([3]))]
    names = {id(t): n for n, t in named}
    sender = VLLMNativeSender(
        ["http://127.0.0.1:1"],
        transport="nccl",
        master_port=29557,
        dtype=torch.bfloat16,
        buffer_bytes=6000,
        num_buffers=2,
    )  # 4 KiB per bf16 tensor: two tensors per pack
    group, client = _Group(line), _Client()
    sender.clients, sender.group, sender.connected = [client], group, True
    try:
        stats = sender.send(named, bucket_bytes=3 * 64 * 32 * 2)  # buckets of three tensors
    finally:
        sender.close()
    assert stats.num_buckets == 2
    ops = [op for _, op, _ in line.log]
    assert (
        ops.count("cast") == len(named)
        and ops.count("pack") >= 3
        and ops.count("broadcast") == ops.count("pack")
    )
    assert {s for s, op, _ in line.log if op == "pack"} <= {"pack1", "pack2"}  # the producer's own streams
    assert line.unordered_packs() == []
    sent = torch.cat(group.sent)
    expected = torch.cat(
        [
            t.to(torch.bfloat16 if t.is_floating_point() else t.dtype).reshape(-1).view(torch.uint8)
            for _, t in named
        ]
    )
    assert torch.equal(sent, expected)


def test_the_ordering_check_catches_a_producer_that_does_not_wait(timeline):
    """The check above is not vacuous: handing freshly cast tensors to the producer with vLLM's
    default protocol (no wait, as megamarl did before) is flagged."""
    line, packed_tensor = timeline
    bucket = []
    for name in ("a", "b"):
        line.add("cast", name)
        bucket.append((name, torch.ones(4)))
    packed_tensor.packed_nccl_broadcast_producer(
        iterator=iter(bucket),
        group=_Group(line),
        src=0,
        post_iter_func=lambda item: item[1],
        buffer_size_bytes=1 << 20,
    )
    assert line.unordered_packs() == [("pack1", ("a", "b"))]
