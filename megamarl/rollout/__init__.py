"""Rollout engines (hf, vllm, vllm_server, sglang, sglang_inprocess) and the replica pool.

Importing this package registers every engine in ``megamarl.rollout.engines.base.ENGINES``; backends that
need optional packages (vllm, sglang) import them only when an engine is constructed.
"""

from megamarl.rollout.engines import hf, sglang, vllm_engine, vllm_server  # noqa: F401 - registration
from megamarl.rollout.engines.base import ENGINES, Engine, Generation, SamplingParams
from megamarl.rollout.replicas.pool import EnginePool

__all__ = ["ENGINES", "Engine", "EnginePool", "Generation", "SamplingParams"]
