"""``build_fleet``'s start-up decisions (no server is started here; tests/integration/test_train_with_servers.py
runs real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megamarl.config import load_config
from megamarl.rollout.fleet import build_fleet

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "signalling_tiny.yaml", list(overrides))


def test_in_process_plans_start_no_fleet(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert build_fleet(_cfg(), rank=0, world_size=2, run_dir=tmp_path, control_group=None) is None


def test_sglang_servers_refuse_allowed_tokens_by_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.engine.backend=sglang", "policies.shared.engine.launch=server")
    with pytest.raises(ValueError, match=r"^agents\.sender\.sampling\.allowed_tokens: policy shared serves through "
                                         r"SGLang"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)


def test_senders_and_clients_by_backend():
    from megamarl.rollout.fleet import CLIENTS, SENDERS
    from megamarl.rollout.server_sync import WeightSender
    from megamarl.rollout.sglang import SGLangClient
    from megamarl.rollout.sglang_sync import SGLangWeightSender
    from megamarl.rollout.vllm_native_sync import VLLMNativeSender
    from megamarl.rollout.vllm_server import VLLMServerClient

    kw = {"master_addr": "127.0.0.1", "master_port": 29999, "replica_tp": [1]}
    sglang = SENDERS["sglang"](["http://127.0.0.1:1"], transport="gloo", **kw)
    assert isinstance(sglang, SGLangWeightSender) and sglang.transport == "gloo"
    vllm = SENDERS["vllm"](["http://127.0.0.1:1"], transport="megamarl_shm", **kw)
    assert type(vllm) is WeightSender and vllm.backend == "megamarl_shm"
    native = SENDERS["vllm"](["http://127.0.0.1:1"], transport="nccl", **kw)
    assert isinstance(native, VLLMNativeSender) and native.transport == "nccl"
    assert isinstance(CLIENTS["sglang"]("http://127.0.0.1:1", "default"), SGLangClient)
    assert isinstance(CLIENTS["vllm"]("http://127.0.0.1:1", "default"), VLLMServerClient)


@pytest.mark.parametrize("choice,colocated,pp,tp,on_gpu,vllm,sglang", [
    ("auto", False, 1, 1, False, "megamarl_gloo", "gloo"),   # CPU: megamarl's data planes
    ("auto", True, 1, 1, False, "megamarl_shm", "gloo"),
    ("auto", True, 2, 1, False, "megamarl_gloo", "gloo"),    # colocated PP>1: a broadcast per stage
    ("auto", False, 1, 2, True, "nccl", "nccl"),             # GPU: the backend's own
    ("auto", True, 1, 1, True, "ipc", "cuda_ipc"),
    ("native", True, 1, 2, True, "megamarl_shm", "cuda_ipc"),  # vLLM IPC needs the replica on one GPU
    ("auto", False, 2, 1, True, "megamarl_gloo", "nccl"),    # a vLLM worker holds one nccl group
    ("megamarl", False, 1, 1, True, "megamarl_gloo", "gloo"),
    ("megamarl", True, 1, 1, True, "megamarl_shm", "gloo"),
])
def test_weight_transfer_choice(choice, colocated, pp, tp, on_gpu, vllm, sglang):
    from types import SimpleNamespace

    from megamarl.rollout.fleet import TRANSPORTS

    engine = SimpleNamespace(weight_transfer=choice, tp=tp)
    assert TRANSPORTS["vllm"](engine, colocated=colocated, pp=pp, on_gpu=on_gpu) == vllm
    assert TRANSPORTS["sglang"](engine, colocated=colocated, pp=pp, on_gpu=on_gpu) == sglang


def test_weight_transfer_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"engine.weight_transfer='nvlink' unknown; allowed: \['auto', 'native', "
                                         r"'megamarl'\]"):
        _cfg("policies.shared.engine.weight_transfer=nvlink")
    cfg = _cfg("policies.shared.engine.weight_transfer=megamarl")  # in-process engines: nothing to choose
    with pytest.raises(ValueError, match=r"^policies\.shared\.engine\.weight_transfer=megamarl applies to engine "
                                         r"servers only"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)
    cfg = _cfg("policies.shared.model=tiny-vllm-llama", "policies.shared.engine.backend=vllm",
               "policies.shared.engine.launch=server", "policies.shared.engine.weight_transfer=native")
    with pytest.raises(ValueError, match=r"^policies\.shared\.engine\.weight_transfer=native needs CUDA"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)


def test_ipc_servers_may_unpickle_handles():
    from megamarl.rollout.server_launch import ServerSpec, server_env

    spec = {"policy": "p", "replica": 0, "rank": 0, "backend": "vllm", "model_path": "m", "on_gpu": True, "devices": (0,)}
    assert server_env(ServerSpec(**spec, weight_transfer="ipc"), base={})["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in server_env(ServerSpec(**spec, weight_transfer="nccl"), base={})


def test_a_seq_len_beyond_the_models_context_names_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.model=tiny-vllm-llama", "policies.shared.engine.backend=vllm",
               "policies.shared.engine.launch=server", "policies.shared.seq_len=4096")
    with pytest.raises(ValueError, match=r"^policies\.shared\.seq_len=4096 exceeds the model's max_position_embeddings=512"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)
