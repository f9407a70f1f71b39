"""A policy's engine from its ``EngineConfig``: the backend's class is looked up in the one engine
registry (``rollout.engines.base.ENGINES``) and built with its ``from_config``; several replicas are always
one ``EnginePool`` (least-loaded routing, failover, one weight update fanned out to all).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megamarl.parallel.hardware import node_cores
from megamarl.rollout.engines.base import ENGINES, Engine
from megamarl.rollout.engines.lora_backends import LoraServing
from megamarl.rollout.replicas.pool import EnginePool

if TYPE_CHECKING:
    from megamarl.config import EngineConfig


def engine_threads(cfg: EngineConfig, *, overlaps_training: bool, num_local_ranks: int) -> int:
    """CPU threads an in-process engine decodes with: ``engine.num_threads``, or (0) every core of
    the node when training waits during rollout, else the driver rank's share of the cores."""
    if cfg.num_threads:
        return cfg.num_threads
    cores = node_cores()
    return max(1, cores // num_local_ranks) if overlaps_training else cores


def build_engine(
    cfg: EngineConfig, path: Path, *, seed: int = 0, lora: LoraServing | None = None, num_threads: int = 0
) -> Engine:
    """``cfg``: ``policies.<p>.engine``; ``lora``: the policy serves L2 adapters (vLLM must be started
    with LoRA enabled); ``num_threads``: CPU threads per in-process engine (0: leave the process's
    setting). Replica ``i`` samples with seed ``seed + i``."""
    cls = ENGINES.get(cfg.backend, key="policies.<p>.engine.backend")

    def replica(i: int) -> Engine:
        return cls.from_config(cfg, path, replica=i, seed=seed + i, lora=lora, num_threads=num_threads)

    return replica(0) if cfg.num_replicas == 1 else EnginePool(replica, cfg.num_replicas, stall_s=cfg.stall_s)
