"""``sglang`` engines: a client for the SGLang HTTP server and a thin in-process wrapper.

The client speaks SGLang 0.5.x's native server: ``POST /generate`` (token ids in, ``output_ids`` and
``meta_info`` with logprobs, finish reason and ``weight_version`` out), weight updates inside a
``/begin_weight_update`` .. ``/end_weight_update`` session (from tensors on one node, or from a
distributed group: ``megamarl.rollout.weights.sglang_sync.SGLangWeightSender``), memory release and
resume, pause and continue, health and model info, and L2 adapters loaded and unloaded by name
(a new version is an unload then a load). ``allowed_token_ids`` is not supported (raises;
``build_fleet`` rejects it at start-up). Logprobs are of the temperature-scaled distribution, the
same quantity as the ``hf``/``vllm`` engines' when top-k/top-p are off. Tested against the real
server on CPU where built (``.venv-sglang``) and always against ``tests/fake_servers.py``'s
``FakeSGLangServer``. The endpoints and payloads, field by field: docs/design-notes.md,
"megamarl/rollout/engines/sglang.py".
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from megamarl.rollout.engines._http import BUSY_PATIENCE_S, EngineHTTPError, JSONClient
from megamarl.rollout.engines.base import ENGINES, Engine, EngineTraits, Generation, SamplingParams, buckets

if TYPE_CHECKING:
    from megamarl.config import EngineConfig


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format. CPU tensors
    travel by the ``file_system`` sharing strategy (a named shared-memory file): with torch's default
    (``file_descriptor``) the server must fetch each descriptor from this process's resource sharer,
    which killed a real SGLang server on CPU."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as torch_mp  # registers the tensor reducers with ForkingPickler

    buf = io.BytesIO()
    strategy = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(named_tensors)
    finally:
        torch_mp.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    return ForkingPickler.loads(base64.b64decode(data))


def sglang_sampling(sampling: SamplingParams, sample_index: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.stop:  # with no_stop_trim the output ids keep the stop string's tokens
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed + sample_index
    return params


def _check(reply: Any, what: str) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {reply.get('message')}")
    return reply


def _check_lora(reply: Any, what: str) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {reply.get('error_message')}")
    return reply


def _version(stamp: Any, default: int) -> int:
    """A server's ``weight_version`` as our integer (SGLang starts at ``"default"``)."""
    try:
        return int(stamp)
    except (TypeError, ValueError):
        return default


@ENGINES.register(
    "sglang",
    traits=EngineTraits(configurable=True, can_sleep=True, serves_lora=True, external=True, server=True),
)
class SGLangClient(Engine):
    """Disaggregated SGLang server at ``base_url`` (``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        tp_size: int = 1,
        bucket_bytes: int = 512 * 2**20,
        health_patience_s: float = BUSY_PATIENCE_S,
    ):
        self.base_url = base_url
        self.health_patience_s = health_patience_s  # ``health``: how long a probe that times out is repeated
        self.http = JSONClient(base_url, timeout_s=timeout_s)
        self.tp_size = tp_size
        self.bucket_bytes = bucket_bytes
        self.weight_version = 0
        self.lora_versions: dict[str, int] = {}
        self._loaded_loras: set[str] = set()
        self._in_flight = 0  # requests of this client the server has not answered yet (``pause`` drains them)
        self._in_flight_lock = threading.Lock()

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, path, *, replica: int, seed: int, lora=None, num_threads: int = 0
    ) -> SGLangClient:
        """Replica ``i`` is the server at ``engine.server_urls[i]``."""
        if replica >= len(cfg.server_urls):
            raise ValueError(
                f"policies.<p>.engine.backend=sglang needs one engine.server_urls entry per replica "
                f"(replica {replica}, {len(cfg.server_urls)} urls)"
            )
        return cls(cfg.server_urls[replica], health_patience_s=cfg.health_patience_s)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        payload: dict[str, Any] = {
            "input_ids": [list(prompt_ids)] * sampling.n,
            "sampling_params": [sglang_sampling(sampling, j) for j in range(sampling.n)],
            "return_logprob": True,
        }
        if sampling.allowed_token_ids:
            raise NotImplementedError(
                "SGLang's sampling parameters have no allowed_token_ids; drop "
                "agents.<a>.sampling.allowed_tokens for SGLang policies or use backend vllm/hf"
            )
        if lora is not None:
            payload["lora_path"] = [lora] * sampling.n
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            replies = await self.http.apost("/generate", payload)
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
        gens = [self._to_generation(r) for r in (replies if isinstance(replies, list) else [replies])]
        if lora is not None:  # the server stamps the base weights' version; an adapter has its own
            gens = [
                Generation(g.token_ids, g.logprobs, g.finish_reason, self.version_for(lora)) for g in gens
            ]
        return gens

    def _to_generation(self, reply: dict) -> Generation:
        meta = reply["meta_info"]
        logprobs = [float(lp) for lp, _tok, *_ in meta["output_token_logprobs"]]
        tokens = reply.get("output_ids") or [int(tok) for _lp, tok, *_ in meta["output_token_logprobs"]]
        reason = (meta.get("finish_reason") or {}).get("type", "length")
        version = _version(meta.get("weight_version"), self.weight_version)
        return Generation(list(tokens), logprobs, "stop" if reason == "stop" else "length", version)

    def version_for(self, lora: str | None) -> int:
        return self.weight_version if lora is None else self.lora_versions.get(lora, 0)

    def server_weight_version(self) -> str:
        """The version the server reports (``/get_model_info``; stamped by ``/update_weight_version``)."""
        return str(self.http.get("/get_model_info")["weight_version"])

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        """Send tensors in buckets through ``/update_weights_from_tensor`` (same-node servers)."""
        if lora is not None:
            raise NotImplementedError(
                "SGLangClient: an adapter update is a new PEFT directory loaded with "
                "add_lora (/load_lora_adapter), not tensors"
            )
        previous: list[tuple[str, torch.Tensor]] = []
        _check(self.http.post("/begin_weight_update", {}), "begin_weight_update")
        try:
            for bucket in buckets(((n, t.detach().contiguous()) for n, t in weights), self.bucket_bytes):
                if previous:
                    self._send_bucket(previous, version=None)
                previous = bucket
            self._send_bucket(previous, version=version)  # the last bucket flushes and stamps the version
        finally:
            _check(self.http.post("/end_weight_update", {}), "end_weight_update")
        self.weight_version = version

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], *, version: int | None) -> None:
        serialized = serialize_named_tensors(bucket)
        payload = {
            "serialized_named_tensors": [serialized] * self.tp_size,
            "load_format": None,
            "flush_cache": version is not None,
            "weight_version": None if version is None else str(version),
        }
        _check(self.http.post("/update_weights_from_tensor", payload), "update_weights_from_tensor")

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        _check(self.http.post("/init_weights_update_group", payload), "init_weights_update_group")

    # -- lifecycle -------------------------------------------------------------------------------

    # -- LoRA (L2) ---------------------------------------------------------------------------------

    def add_lora(self, name: str, path) -> None:
        """(Re)load PEFT adapter directory ``path`` as ``name``: SGLang refuses a name it already
        serves, so a new version unloads the old one first (the caller has paused the server)."""
        from pathlib import Path

        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(
                f"LoRA '{name}': {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
        if name in self._loaded_loras:
            _check_lora(self.http.post("/unload_lora_adapter", {"lora_name": name}), "unload_lora_adapter")
            self._loaded_loras.discard(name)
        _check_lora(
            self.http.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}),
            "load_lora_adapter",
        )
        self._loaded_loras.add(name)
        self.lora_versions.setdefault(name, 0)

    # -- lifecycle -------------------------------------------------------------------------------

    def sleep(self, *, level: int = 1) -> None:
        """Level 1: release weights and KV cache (the hand-over to training; the next push rewrites
        the weights); level 2: everything SGLang holds (also CUDA graphs)."""
        tags = None if level >= 2 else ["weights", "kv_cache"]
        self._wait_idle()
        _check(self.http.post("/release_memory_occupation", {"tags": tags}), "release_memory_occupation")

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until the scheduler is idle. SGLang's ``release_memory_occupation`` *asserts* idleness and
        the failed assertion kills the server; a request's HTTP reply can arrive before the scheduler
        has cleared its last batch (seen on a loaded 2-core CI machine: the colocated replica crashed
        on its sleep). ``/flush_cache`` checks the same idleness and answers 400 instead, so it is
        polled until it succeeds (the KV cache is released next anyway)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.http.post("/flush_cache")
                return
            except EngineHTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Resume ``tags`` in order (weights first, so a push can land before the KV cache returns);
        None: everything."""
        for tag in [None] if tags is None else list(tags):
            _check(
                self.http.post("/resume_memory_occupation", {"tags": None if tag is None else [tag]}),
                "resume_memory_occupation",
            )

    def pause(self, *, drain_timeout_s: float = 600.0) -> None:
        """Requests already sent finish first (like vLLM's ``/pause?mode=wait``), then the scheduler
        pauses in place; the caller stops new requests (``EnginePool``)."""
        deadline = time.monotonic() + drain_timeout_s
        while self._in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.http.post("/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        self.http.post("/continue_generation", {})

    def flush_cache(self) -> None:
        self.http.post("/flush_cache")

    def health(self) -> bool:
        # a busy server is given time; a refused one is dead at once
        return self.http.answers("/health", patience_s=self.health_patience_s)

    def shutdown(self) -> None:
        self.http.close()


@ENGINES.register("sglang_inprocess", traits=EngineTraits(in_process=True, can_sleep=True))
class SGLangEngine(Engine):
    """In-process ``sglang.Engine`` (needs the ``sglang`` package and a GPU)."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(
                "SGLangEngine needs the 'sglang' package (pip install 'megamarl[sglang]', GPU only); "
                "on CPU use engine 'vllm' or 'hf', or SGLangClient against a running server"
            ) from exc
        self._engine = sglang.Engine(model_path=model, **engine_kwargs)
        self.weight_version = 0

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        out = await self._engine.async_generate(
            input_ids=[list(prompt_ids)] * sampling.n,
            sampling_params=[sglang_sampling(sampling, j) for j in range(sampling.n)],
            return_logprob=True,
            lora_path=None if lora is None else [lora] * sampling.n,
        )
        # same reply shape as HTTP; _to_generation reads only self.weight_version (duck-typed)
        return [SGLangClient._to_generation(self, r) for r in out]  # type: ignore[arg-type]

    def update_weights(self, weights, *, version: int, lora: str | None = None) -> None:
        self._engine.update_weights_from_tensor(list(weights), flush_cache=True)
        self.weight_version = version

    def sleep(self, *, level: int = 1) -> None:
        self._engine.release_memory_occupation()

    def wake(self) -> None:
        self._engine.resume_memory_occupation()

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def shutdown(self) -> None:
        self._engine.shutdown()
