"""A policy's engine from its ``EngineConfig``: the backend's class is looked up in the one engine
registry (``rollout.base.ENGINES``) and built with its ``from_config``; several replicas are always
one ``EnginePool`` (least-loaded routing, failover, one weight update fanned out to all).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megamarl.rollout import ENGINES, Engine, EnginePool


@dataclass
class LoraServing:
    num_adapters: int
    rank: int


def build_engine(cfg, path: Path, *, seed: int = 0, lora: LoraServing | None = None) -> Engine:
    """``cfg``: ``policies.<p>.engine``; ``lora``: the policy serves L2 adapters (vLLM must be started
    with LoRA enabled). Replica ``i`` samples with seed ``seed + i``."""
    cls = ENGINES.get(cfg.backend, key="policies.<p>.engine.backend")

    def replica(i: int) -> Engine:
        return cls.from_config(cfg, path, replica=i, seed=seed + i, lora=lora)

    return replica(0) if cfg.num_replicas == 1 else EnginePool(replica, cfg.num_replicas)
