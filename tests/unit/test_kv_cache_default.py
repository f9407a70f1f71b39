"""``engine.kv_cache_gib`` by default: the plan's figure on GPUs, 1 GiB on CPU
(``EngineConfig.kv_cache_setting``).

A 1 GiB default on GPU held two 4k sequences of an 8B model, and vLLM refuses to start when the
cache cannot hold one sequence of ``max_model_len``: checked here with vLLM's own check and KV spec.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megamarl.config import EngineConfig, PolicyConfig
from megamarl.planning.dryrun import GIB, engine_memory
from megamarl.planning.model_presets import PRESETS


def test_default_resolves_by_device_and_explicit_values_stay():
    assert EngineConfig().kv_cache_gib is None
    assert EngineConfig().kv_cache_setting(on_gpu=True) == 0.0  # the plan's figure
    assert EngineConfig().kv_cache_setting(on_gpu=False) == 1.0
    for value in (0.0, 0.25, 24.0):
        assert EngineConfig(kv_cache_gib=value).kv_cache_setting(on_gpu=True) == value
        assert EngineConfig(kv_cache_gib=value).kv_cache_setting(on_gpu=False) == value
    with pytest.raises(ValueError, match="kv_cache_gib"):
        EngineConfig(kv_cache_gib=-1.0)


def _vllm_check(seq_len: int, kv_bytes: float, shape) -> None:
    """vLLM's start-up check that the KV cache holds one sequence of ``max_model_len`` (bf16, TP=1)."""
    import torch
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim, dtype=torch.bfloat16
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=seq_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    needed = shape.num_layers * spec.max_memory_usage_bytes(config)
    _check_enough_kv_cache_memory(int(kv_bytes), lambda: needed, seq_len, lambda available: 0)


def test_gpu_default_serves_a_32k_context_that_1_gib_could_not():
    pytest.importorskip("vllm")
    shape = PRESETS["llama3-8b"]
    policy = PolicyConfig(model="llama3-8b", seq_len=32768)
    on_gpu = engine_memory(shape, policy, on_gpus=True)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    assert on_gpu.kv_cache == policy.engine.max_num_seqs * 32768 * per_token  # the plan's figure
    _vllm_check(32768, on_gpu.kv_cache, shape)
    on_cpu = engine_memory(shape, policy, on_gpus=False)
    assert on_cpu.kv_cache == 1 * GIB
    with pytest.raises(ValueError, match="max seq len"):  # the old GPU default: vLLM refuses to start
        _vllm_check(32768, on_cpu.kv_cache, shape)
