"""Engines for a policy from its ``EngineConfig``: the backend is looked up by name.

``vllm`` falls back to ``hf`` when the vllm package is not installed (logged once), so the same config
runs on a laptop without vLLM and on a GPU node with it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from megamarl.config import EngineConfig
from megamarl.parallel.hardware import DTYPES, node_cores, resolve_dtype
from megamarl.rollout.base import Engine


def _hf(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None, num_threads: int = 0) -> Engine:
    from megamarl.rollout.hf import HFEngine

    dtype = DTYPES[resolve_dtype(cfg.dtype)]
    return HFEngine(path, seed=seed, max_batch_rows=cfg.max_num_seqs, dtype=dtype, num_threads=num_threads)


def _vllm(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None, num_threads: int = 0) -> Engine:
    if importlib.util.find_spec("vllm") is None:
        print("[megamarl] engine.backend=vllm but vllm is not installed: using the hf engine", flush=True)
        return _hf(cfg, path, seed, num_threads=num_threads)
    from megamarl.rollout.vllm_engine import VLLMEngine

    lora_kwargs = dict(enable_lora=True, max_loras=max(lora.num_adapters, 1), max_lora_rank=lora.rank) if lora else {}
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[resolve_dtype(cfg.dtype)]
    return VLLMEngine(path, seed=seed, kv_cache_bytes=int(cfg.kv_cache_gib * 2**30), dtype=dtype,
                      num_threads=num_threads, max_num_seqs=cfg.max_num_seqs, **lora_kwargs)


def _sglang(cfg: EngineConfig, path: Path, seed: int, lora: LoraServing | None = None, num_threads: int = 0) -> Engine:
    from megamarl.rollout.sglang import SGLangClient

    if not cfg.server_urls:
        raise ValueError("policies.<p>.engine.backend=sglang needs engine.server_urls (SGLang servers)")
    return SGLangClient(cfg.server_urls[0])


@dataclass
class LoraServing:
    num_adapters: int
    rank: int


BUILDERS = {"hf": _hf, "vllm": _vllm, "sglang": _sglang}


def engine_threads(cfg: EngineConfig, *, overlaps_training: bool, num_local_ranks: int) -> int:
    """CPU threads an in-process engine decodes with: ``engine.num_threads``, or (0) every core of
    the node when training waits during rollout, else the driver rank's share of the cores."""
    if cfg.num_threads:
        return cfg.num_threads
    cores = node_cores()
    return max(1, cores // num_local_ranks) if overlaps_training else cores


def build_engines(cfg: EngineConfig, path: Path, *, seed: int = 0, lora: LoraServing | None = None,
                  num_threads: int = 0) -> list[Engine]:
    """``lora``: the policy serves L2 adapters (vLLM must be started with LoRA enabled);
    ``num_threads``: CPU threads per in-process engine (0: leave the process's setting)."""
    build = BUILDERS[cfg.backend]
    return [build(cfg, path, seed + i, lora, num_threads) for i in range(cfg.num_replicas)]
