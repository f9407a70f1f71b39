"""vLLM's NCCL weight sender runs in the trainer's process (it imports vLLM there): on GPU, a policy
whose vLLM servers run from another interpreter (``engine.server_python``) while the trainer cannot
import vLLM is refused when the transport is chosen (at fleet start), naming the keys. The trainer's
environment without vLLM is simulated by hiding the package from ``importlib.util.find_spec``."""

import importlib.util

import pytest

from megamarl.config import EngineConfig
from megamarl.rollout.weights import transport
from megamarl.rollout.weights.transport import vllm_transport


@pytest.fixture
def no_vllm_here(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )


def test_nccl_sender_without_vllm_in_the_trainer_is_refused_naming_the_keys(no_vllm_here):
    engine = EngineConfig(backend="vllm", server_python="/opt/vllm-env/bin/python")
    with pytest.raises(
        ValueError,
        match=r"engine\.weight_transfer='auto'.*cannot import vllm.*server_python.*"
        r"weight_transfer: megamarl",
    ):
        vllm_transport(engine, colocated=False, pp=1, on_gpu=True)
    with pytest.raises(ValueError, match=r"cannot import vllm"):  # PP>1: the stages gather to one NCCL sender
        vllm_transport(engine, colocated=False, pp=2, on_gpu=True)


def test_transports_that_need_no_vllm_here_still_start(no_vllm_here):
    engine = EngineConfig(backend="vllm", server_python="/opt/vllm-env/bin/python")
    assert (
        vllm_transport(engine, colocated=True, pp=1, on_gpu=True) == "ipc"
    )  # torch's CUDA IPC handles, HTTP
    assert vllm_transport(engine, colocated=True, pp=2, on_gpu=True) == "ipc"  # the leader relays the stages
    assert vllm_transport(engine, colocated=False, pp=1, on_gpu=False) == "megamarl_gloo"
    megamarl = EngineConfig(
        backend="vllm", server_python="/opt/vllm-env/bin/python", weight_transfer="megamarl"
    )
    assert vllm_transport(megamarl, colocated=False, pp=1, on_gpu=True) == "megamarl_gloo"


def test_nccl_sender_with_vllm_importable_here(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert vllm_transport(EngineConfig(backend="vllm"), colocated=False, pp=1, on_gpu=True) == "nccl"
    assert transport.check_nccl_sender(EngineConfig(backend="vllm")) is None
