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


def test_sglang_servers_are_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.engine.backend=sglang", "policies.shared.engine.launch=server",
               "policies.shared.engine.dtype=auto")
    with pytest.raises(ValueError, match=r"^policies\.shared\.engine\.backend=sglang with launch=server: megamarl "
                                         r"pushes weights into servers through vLLM's weight-transfer endpoints only"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)


def test_a_seq_len_beyond_the_models_context_names_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.model=tiny-vllm-llama", "policies.shared.engine.backend=vllm",
               "policies.shared.engine.launch=server", "policies.shared.seq_len=4096")
    with pytest.raises(ValueError, match=r"^policies\.shared\.seq_len=4096 exceeds the model's max_position_embeddings=512"):
        build_fleet(cfg, rank=0, world_size=2, run_dir=tmp_path, control_group=None)
