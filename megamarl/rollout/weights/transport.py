"""How pushes reach a policy's engine servers: the data plane (``TRANSPORTS`` by engine backend, from
``engine.weight_transfer``; the same string goes on the server's command line and into the sender) and
the sender that speaks it (``SENDERS`` by engine backend: connect/begin/send/end/push/close). The one
place for the transport choice."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from megamarl.rollout.weights.server_sync import WeightSender
from megamarl.rollout.weights.sglang_sync import SGLangWeightSender
from megamarl.rollout.weights.vllm_native_sync import TRANSPORTS as VLLM_NATIVE
from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender

if TYPE_CHECKING:
    from megamarl.config import PolicyConfig


def vllm_transport(engine, *, colocated: bool, pp: int, on_gpu: bool) -> str:
    """The data plane into a policy's vLLM replicas (their ``--weight-transfer-config`` backend and the
    sender's), from ``engine.weight_transfer``. A colocated replica is fed by its own leader rank at any
    PP (at PP>1 the leader first receives the other stages' layers point to point: ``RELAYS``): CUDA
    IPC at engine TP=1 on GPU, else shared memory (an NCCL group would hold the leader's rank and a
    replica worker on one GPU, which NCCL refuses). Disaggregated replicas: NCCL on GPU (a vLLM worker
    holds ONE nccl group: the stages gather to stage 0's sender, ``GATHERS``), a gloo broadcast per
    stage on CPU or with ``weight_transfer: megamarl`` (docs/cluster.md)."""
    native = on_gpu and engine.weight_transfer != "megamarl"
    if colocated:
        return "ipc" if native and engine.tp == 1 else "megamarl_shm"
    if native and not colocated:
        check_nccl_sender(engine)
        return "nccl"
    return "megamarl_gloo"


def check_nccl_sender(engine) -> None:
    """vLLM's NCCL sender runs in the trainer (``vllm_native_sync._open_nccl``/``_broadcast_bucket``
    import vLLM there), whatever interpreter the servers run from: refuse at start, naming the keys,
    when this one cannot import vLLM (servers from ``engine.server_python``, a trainer without vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            f"policies.<p>.engine.weight_transfer='{engine.weight_transfer}' pushes into GPU vLLM servers "
            "with vLLM's "
            "NCCL engine, whose sending end runs in the trainer, but the trainer's Python "
            f"({sys.executable}) "
            f"cannot import vllm (engine.server_python={engine.server_python!r} runs the servers only): "
            "install vllm "
            "in the trainer's environment, or set engine.weight_transfer: megamarl"
        )


def sglang_transport(engine, *, colocated: bool, pp: int, on_gpu: bool) -> str:
    """SGLang's own data planes on GPU (CUDA IPC into a colocated PP=1 replica fed by its own rank,
    NCCL otherwise); a gloo group on CPU or with ``engine.weight_transfer: megamarl`` (on CPU also for
    a colocated replica: its own leader rank is the group's sender)."""
    if not on_gpu or engine.weight_transfer == "megamarl":
        return "gloo"
    return "cuda_ipc" if colocated and pp == 1 else "nccl"


# (engine backend, transport) whose server side holds ONE transfer group per worker (vLLM's NCCL
# engine keeps one ``model_update_group``; a second init replaces it): a PP>1 policy gathers its stages
# to stage 0's sender, which alone connects and sends (``stage_gather``). The others (megamarl_gloo,
# SGLang's named groups) take a group per stage's sender.
GATHERS = frozenset({("vllm", "nccl")})
# (engine backend, transport) that feed a colocated replica from its leader rank through local memory
# (shared memory, CUDA IPC): at PP>1 that leader receives the other stages' layers point to point from
# its DP replica's stage peers over the training world, and feeds them with its own (``stage_relay``).
RELAYS = frozenset({("vllm", "megamarl_shm"), ("vllm", "ipc")})
# engine backend -> whether its servers take several stages' buckets at once. vLLM (megamarl_gloo)
# posts a bucket's receive and returns, so two stages' broadcasts interleave; an SGLang server runs one
# update request at a time, blocking in its receive, so two stages sending at once could each hold one
# replica while the other replica waits for the other stage: stages send in pp order.
CONCURRENT_STAGES: dict[str, bool] = {"vllm": True, "sglang": False}


def _vllm_sender(urls: list[str], *, transport: str, **kw) -> WeightSender | VLLMNativeSender:
    if transport in VLLM_NATIVE:
        return VLLMNativeSender(urls, transport=transport, **kw)
    return WeightSender(urls, backend=transport, **kw)


def _sglang_sender(urls: list[str], *, transport: str, **kw) -> SGLangWeightSender:
    return SGLangWeightSender(urls, transport=transport, **kw)


# engine backend -> how its servers receive weights (the transport from the policy's engine config)
TRANSPORTS: dict[str, Callable[..., str]] = {"vllm": vllm_transport, "sglang": sglang_transport}
# engine backend -> the weight sender into its servers (connect/begin/send/end/push/close)
SENDERS: dict[str, Callable[..., WeightSender | VLLMNativeSender | SGLangWeightSender]] = {
    "vllm": _vllm_sender,
    "sglang": _sglang_sender,
}


def transport_for(policy: PolicyConfig, *, colocated: bool, on_gpu: bool) -> str:
    """The data plane of pushes into the servers of ``policy`` (``policies.<p>``; ``TRANSPORTS``)."""
    return TRANSPORTS[policy.engine.backend](policy.engine, colocated=colocated, pp=policy.pp, on_gpu=on_gpu)


def gathers_stages(policy: PolicyConfig, *, colocated: bool, on_gpu: bool) -> bool:
    """A PP>1 push into ``policy``'s servers goes through stage 0's sender alone (``GATHERS``)."""
    transport = transport_for(policy, colocated=colocated, on_gpu=on_gpu)
    return policy.pp > 1 and (policy.engine.backend, transport) in GATHERS


def relays_stages(policy: PolicyConfig, *, colocated: bool, on_gpu: bool) -> bool:
    """A push into ``policy``'s colocated replicas goes from each replica's leader rank, which holds (or
    receives, at PP>1) every stage's tensors (``RELAYS``)."""
    transport = transport_for(policy, colocated=colocated, on_gpu=on_gpu)
    return colocated and (policy.engine.backend, transport) in RELAYS
