"""The ``vllm.general_plugins`` entry point (``pyproject.toml``): registers megamarl's weight-transfer
backends (``megamarl.rollout.weights.vllm_plugin``) with vLLM in every vLLM process.

It lives outside ``megamarl.rollout`` on purpose: vLLM calls it in the API server and engine-core
processes too, and importing ``megamarl.rollout`` there would apply the in-process engine's
defaults (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to a server. The backends are registered by module
path, so only a worker that actually uses one imports it. Idempotent: vLLM may call it repeatedly.
"""

from __future__ import annotations

BACKENDS = {"megamarl_gloo": "GlooWeightTransferEngine", "megamarl_shm": "ShmWeightTransferEngine"}


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls_name in BACKENDS.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(
                name, "megamarl.rollout.weights.vllm_plugin", cls_name
            )
