"""``vllm_server`` engine: a client for a disaggregated vLLM OpenAI-compatible server.

Protocol followed: vLLM 0.32 (``vllm serve``; the RL endpoints need ``VLLM_SERVER_DEV_MODE=1``
and a ``--weight-transfer-config``):

- ``POST /v1/completions`` with ``prompt`` as a list of token ids, ``logprobs: 0``,
  ``return_token_ids: true`` (choices carry ``token_ids``), ``skip_special_tokens: false`` and
  vLLM's extra sampling fields ``top_k``, ``seed``, ``stop_token_ids``. Logprobs are the server's
  ``--logprobs-mode``; start it with ``--logprobs-mode processed_logprobs`` for the definition the
  in-process engines use.
- Weight update (vLLM's weight-transfer engine): ``POST /start_weight_update``; per bucket
  ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes", "packed": false}}``
  while the trainer broadcasts those tensors on the transfer group (the ``transport``; set up with
  ``POST /init_weight_transfer_engine {"init_info": {...}}``); ``POST /finish_weight_update
  {"weight_version": "7"}``; ``POST /reset_prefix_cache``.
- ``POST /pause?mode=wait`` / ``POST /resume``, ``POST /sleep?level=N`` / ``POST /wake_up``,
  ``GET /health``.

Tested against ``megamarl.rollout.fakes.FakeVLLMServer`` (the same protocol backed by an HF model):
starting ``vllm serve`` on the 2-core CPU test machine takes too long for a unit test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Protocol

import torch

from megamarl.rollout._http import JSONClient
from megamarl.rollout.base import ENGINES, Engine, EngineTraits, Generation, SamplingParams
from megamarl.rollout.weight_sync import buckets


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


@ENGINES.register("vllm_server", traits=EngineTraits(can_sleep=True, serves_lora=False, external=True))
class VLLMServerClient(Engine):
    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        transport: WeightTransport | None = None,
        bucket_bytes: int = 512 * 2**20,
        timeout_s: float = 600.0,
    ) -> None:
        self.http = JSONClient(base_url, timeout_s=timeout_s)
        self.model = model
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.weight_version = 0

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
        reply = await self.http.apost("/v1/completions", payload)
        version = self.weight_version
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
            raise NotImplementedError("VLLMServerClient: adapter updates go through /v1/load_lora_adapter")
        if self.transport is None:
            raise RuntimeError(
                "VLLMServerClient.update_weights needs a transport (the broadcast group the server "
                "joined via init_weight_transfer); pass transport=BroadcastTransport(group)"
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
        self.transport.send([t for _, t in bucket])
        reply.result()

    def sleep(self, *, level: int = 1) -> None:
        self.http.post("/sleep", query={"level": level})

    def wake(self) -> None:
        self.http.post("/wake_up")

    def pause(self) -> None:
        self.http.post("/pause", query={"mode": "wait"})

    def resume(self) -> None:
        self.http.post("/resume")

    def flush_cache(self) -> None:
        self.http.post("/reset_prefix_cache")

    def health(self) -> bool:
        try:
            self.http.get("/health", timeout_s=5)
            return True
        except Exception:  # noqa: BLE001
            return False

    def shutdown(self) -> None:
        self.http.close()
