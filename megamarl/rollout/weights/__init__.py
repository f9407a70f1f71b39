"""Weight transfer into engines: the in-process path through the driver (``weight_sync``), the
senders into engine servers (``server_sync``, ``sglang_sync``, ``vllm_native_sync``), the server-side
vLLM plugin (``vllm_plugin``), the transport choice (``transport``) and the greedy-token check
(``sync_check``). Imports ``rollout.engines`` and layers 0-1."""
