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
    from megamarl.rollout.vllm_server import VLLMServerClient

    kw = {"master_addr": "127.0.0.1", "master_port": 29999, "replica_tp": [1]}
    sglang = SENDERS["sglang"](["http://127.0.0.1:1"], colocated=False, on_gpu=False, **kw)
    assert isinstance(sglang, SGLangWeightSender) and sglang.transport == "gloo"
    assert SENDERS["sglang"](["http://127.0.0.1:1"], colocated=True, on_gpu=False, **kw).transport == "gloo"
    assert SENDERS["sglang"](["http://127.0.0.1:1"], colocated=False, on_gpu=True, **kw).transport == "nccl"
    vllm = SENDERS["vllm"](["http://127.0.0.1:1"], colocated=True, on_gpu=False, **kw)
    assert isinstance(vllm, WeightSender) and vllm.backend == "megamarl_shm"
    assert isinstance(CLIENTS["sglang"]("http://127.0.0.1:1", "default"), SGLangClient)
    assert isinstance(CLIENTS["vllm"]("http://127.0.0.1:1", "default"), VLLMServerClient)


def test_a_seq_len_beyond_the_models_context_names_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.model=tiny-vllm-llama", "policies.shared.engine.backend=vllm",
               "policies.shared.engine.launch=server", "policies.shared.seq_len=4096")
    with pytest.raises(ValueError, match=r"^policies\.shared\.seq_len=4096 exceeds the model's max_position_embeddings=512"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)
