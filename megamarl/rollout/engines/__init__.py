"""Rollout engines: the ``Engine`` protocol and its registry (``base``), request batching, the HTTP
client, and the backends: in-process ``hf`` / ``vllm_engine`` and the server clients ``vllm_server`` /
``sglang``. Imports only megamarl layers 0-1 (config, registry, parallel, models)."""
