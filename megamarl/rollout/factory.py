"""Engines for a policy from its ``EngineConfig``: the backend is looked up by name.

``vllm`` falls back to ``hf`` when the vllm package is not installed (logged once), so the same config
runs on a laptop without vLLM and on a GPU node with it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from megamarl.config import EngineConfig
from megamarl.rollout.base import Engine


def _hf(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None) -> Engine:
    from megamarl.rollout.hf import HFEngine

    return HFEngine(path, seed=seed, max_batch_rows=cfg.max_num_seqs)


def _vllm(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None) -> Engine:
    if importlib.util.find_spec("vllm") is None:
        print("[megamarl] engine.backend=vllm but vllm is not installed: using the hf engine", flush=True)
        return _hf(cfg, path, seed)
    from megamarl.rollout.vllm_engine import VLLMEngine

    lora_kwargs = dict(enable_lora=True, max_loras=max(lora.num_adapters, 1), max_lora_rank=lora.rank) if lora else {}
    return VLLMEngine(path, seed=seed, kv_cache_bytes=int(cfg.kv_cache_gib * 2**30), **lora_kwargs)


def _sglang(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None) -> Engine:
    from megamarl.rollout.sglang import SGLangClient

    if not cfg.server_urls:
        raise ValueError("policies.<p>.engine.backend=sglang needs engine.server_urls (SGLang servers)")
    return SGLangClient(cfg.server_urls[0])


@dataclass
class LoraServing:
    num_adapters: int
    rank: int


BUILDERS = {"hf": _hf, "vllm": _vllm, "sglang": _sglang}


def build_engines(cfg: EngineConfig, path: Path, *, seed: int = 0, lora: LoraServing | None = None) -> list[Engine]:
    """``lora``: the policy serves L2 adapters (vLLM must be started with LoRA enabled)."""
    build = BUILDERS[cfg.backend]
    return [build(cfg, path, seed + i, lora) for i in range(cfg.num_replicas)]
