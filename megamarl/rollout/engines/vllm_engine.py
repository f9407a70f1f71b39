"""``vllm`` engine: an in-process (colocated) vLLM ``LLMEngine`` with continuous batching.

The synchronous ``vllm.LLM`` is built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so weights
reload in place) and its ``LLMEngine`` is driven from one background thread under one lock:
concurrent ``generate`` calls join the running engine between steps, each resolving its caller's
future. On a multi-rank job vLLM lives in a private ``torch.distributed`` world
(``megamarl.rollout.engines.private_world``). Logprobs are ``processed_logprobs`` (as the ``hf``
engine's). ``update_weights`` streams HF-named tensors (whole vLLM layers) into vLLM's in-place
reload and flushes the prefix cache. ``sleep``/``wake`` are vLLM's on GPUs and the nearest real
thing on CPU (level 2 frees the weight storages; weights are then re-sent in full). L2 adapters:
``add_lora(name, path)``, ``generate(..., lora=name)``, ``update_weights(..., lora=name)`` reloads the
adapter in place and stamps ``lora_versions[name]``. Details (why in-process, CPU sleep, tied LM
head): docs/design-notes.md, "megamarl/rollout/engines/vllm_engine.py".
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Must precede any vllm import in this process: keep the engine core in-process (colocation and
# in-place weight reload both need it).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM logs every request-level detail at INFO and, on each in-place reload, warnings about layers it
# skips; megamarl reports what matters itself. Set VLLM_LOGGING_LEVEL=INFO to see vLLM's own log.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch

from megamarl.parallel.hardware import drop_pages, release_cached_memory, resolve_dtype
from megamarl.rollout.engines.base import ENGINES, EngineTraits, Generation, InProcessEngine, SamplingParams
from megamarl.rollout.engines.batching import _set_exception, _set_result
from megamarl.rollout.engines.hf import HFEngine  # the fallback without vllm
from megamarl.rollout.engines.private_world import PrivateWorld

if TYPE_CHECKING:
    from megamarl.config import EngineConfig

CPU_KV_CACHE_BYTES = 256 * 2**20  # small default KV cache on CPU (vLLM's own default is GiBs)
# vLLM's torch.distributed world, kept apart from the trainer's (one per process: vLLM's parallel
# state is process-global, so every in-process engine shares it).
VLLM_WORLD = PrivateWorld()


PROCESS_ENGINE_LOCK = threading.RLock()
_LIVE_ENGINES: set[int] = set()  # id() of this process's running engines (under PROCESS_ENGINE_LOCK)


def _reload_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.reload_weights(weights_iterator=weights)
    _repack_tied_lm_head(worker.model_runner.get_model())


def _repack_tied_lm_head(model) -> None:
    """vLLM-CPU packs the LM head's GEMM weight when the model loads (``dispatch_cpu_unquantized_gemm``
    keeps a oneDNN/sgl-kernel copy). A tied head receives no tensor in a reload (its weight is the
    embedding's), so vLLM 0.32 never repacks it and the logits would keep using the old embedding
    (measured: |dlogprob| ~0.3 after a 0.01 perturbation). Repack it from the reloaded weight."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    if tied and hasattr(lm_head, "cpu_linear"):
        assert lm_head is not None  # tied
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _weight_storages(worker) -> list[torch.UntypedStorage]:
    seen, storages = set(), []
    for param in worker.model_runner.get_model().parameters():
        storage = param.untyped_storage()
        if storage.data_ptr() not in seen:  # tied weights share one storage
            seen.add(storage.data_ptr())
            storages.append(storage)
    return storages


def _discard_weights(worker) -> int:
    storages = _weight_storages(worker)
    worker._megamarl_discarded = [(s, s.nbytes()) for s in storages]
    for storage in storages:
        storage.resize_(0)
    return sum(nbytes for _, nbytes in worker._megamarl_discarded)


def _restore_weight_storage(worker) -> None:
    for storage, nbytes in getattr(worker, "_megamarl_discarded", []):
        storage.resize_(nbytes)
    worker._megamarl_discarded = []


def _drop_kv_cache_pages(worker) -> int:
    """The KV cache's memory back to the kernel (its blocks hold nothing once the prefix cache is
    reset; they read as zeros and take pages again as the next rollout writes them)."""
    storages = {}
    for kv in worker.model_runner.kv_caches:
        for tensor in kv if isinstance(kv, (list, tuple)) else [kv]:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
    return sum(drop_pages(storage) for storage in storages.values())


def _weight_bytes(worker) -> int:
    return sum(p.untyped_storage().nbytes() for p in worker.model_runner.get_model().parameters())


def to_generations(output: Any, version: int) -> list[Generation]:
    """vLLM ``RequestOutput`` -> our ``Generation`` list (sampled-token logprobs only)."""
    generations = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        tokens = list(completion.token_ids)
        logprobs = [
            float(step[tok].logprob) for step, tok in zip(completion.logprobs, tokens, strict=False)
        ]  # strict=False: vLLM gives a logprob entry per sampled token
        reason = "stop" if completion.finish_reason == "stop" else completion.finish_reason or "length"
        generations.append(Generation(tokens, logprobs, reason, version))
    return generations


def to_vllm_sampling(sampling: SamplingParams):
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(0, sampling.top_k),  # vLLM: 0 (or -1) disables
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        seed=sampling.seed,
        logprobs=0,  # the sampled token's logprob only
        output_kind=RequestOutputKind.FINAL_ONLY,
        # stop strings are matched on detokenized text; the ids keep every sampled token either way
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        detokenize=bool(sampling.stop),
        allowed_token_ids=list(sampling.allowed_token_ids) or None,
    )


@ENGINES.register(
    "vllm",
    traits=EngineTraits(configurable=True, in_process=True, can_sleep=True, serves_lora=True, server=True),
)
class VLLMEngine(InProcessEngine):
    """In-process vLLM serving one policy (and, with ``enable_lora``, its LoRA adapters)."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int = 2048,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        lora_dir: str | Path | None = None,
        num_threads: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        super().__init__()
        self.on_cpu = current_platform.is_cpu()
        self.native_sleep = current_platform.is_sleep_mode_available()
        if kv_cache_bytes is None and self.on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        kwargs: dict[str, Any] = {
            "model": str(model),
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "gpu_memory_utilization": gpu_memory_utilization,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self.native_sleep,
        }
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if enable_lora:
            kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
        kwargs.update(engine_kwargs)
        # vLLM-CPU sizes its attention metadata for the constructing thread's OpenMP team, and the
        # driver thread must use the same team size. ``num_threads`` > 0 sets it for both (the
        # calling thread gets its own count back: training keeps one thread per rank). vLLM replaces
        # torch.set_num_threads with a no-op after binding its threads, hence torch._C's.
        caller_threads = torch.get_num_threads()
        if num_threads > 0:
            torch._C.set_num_threads(num_threads)
        try:
            with VLLM_WORLD.active():
                self.llm = LLM(**kwargs)
            self._num_threads = torch.get_num_threads()
        finally:
            torch._C.set_num_threads(caller_threads)
        self._engine = self.llm.llm_engine
        with PROCESS_ENGINE_LOCK:
            _LIVE_ENGINES.add(id(self))
        self.weight_version = 0
        self.enable_lora = enable_lora
        self._loras: dict[str, Any] = {}  # name -> LoRARequest
        self._lora_dir = Path(lora_dir) if lora_dir else Path(tempfile.mkdtemp(prefix="megamarl-lora-"))

        # Every LLMEngine call, of every in-process engine: vLLM keeps per-process state (the forward
        # context, the CPU attention backend's scratch buffers), so two engines of one process (an L3
        # run's policies on rank 0) stepped from their own threads corrupt the heap (vLLM-CPU 0.x:
        # "double free or corruption"). One lock per process serialises them; each step still runs
        # on all of the engine's threads.
        self._lock = PROCESS_ENGINE_LOCK
        # New requests queue under their own lock: a caller must never wait for a running engine step
        # (the rollout event loop would stall and requests would trickle in one per step).
        self._inbox_lock = threading.Lock()
        # (request id, prompt, params, adapter name, LoRARequest, caller's loop, future)
        self._inbox: list[
            tuple[str, dict, Any, str | None, Any, asyncio.AbstractEventLoop, asyncio.Future]
        ] = []
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, str | None]] = {}
        self._hold = False  # set while draining for a weight change: inbox requests wait
        self._wakeup = threading.Event()
        self._weights_valid = True
        self._next_id = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._drive, name="vllm-engine-driver", daemon=True)
        self._thread.start()

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        lora_request = self._lora_request(lora)
        await self._admitted()
        if not self._weights_valid:
            raise RuntimeError("weights were discarded by sleep(level=2); call update_weights first")
        if self._error is not None or self._stopped:
            raise RuntimeError(f"vLLM engine is not running: {self._error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        params = to_vllm_sampling(sampling)
        with self._inbox_lock:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
            prompt = {"prompt_token_ids": list(prompt_ids)}
            self._inbox.append((request_id, prompt, params, lora, lora_request, loop, future))
        self._wakeup.set()
        return await future

    def _drive(self) -> None:
        """Background thread: admit queued requests, step the engine, deliver finished outputs."""
        torch._C.set_num_threads(self._num_threads)
        while not self._stopped:
            try:
                with self._lock:
                    if not self._hold:
                        self._admit()
                    outputs = self._engine.step() if self._engine.has_unfinished_requests() else None
                    finished = []  # weights change only while drained: the version now is the one used
                    for output in outputs or []:
                        if output.finished and output.request_id in self._futures:
                            loop, future, lora = self._futures.pop(output.request_id)
                            finished.append((loop, future, output, self.version_for(lora)))
            except Exception as exc:  # noqa: BLE001 - fail every waiting caller, then stop
                self._fail_all(exc)
                return
            if outputs is None:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            for loop, future, output, version in finished:
                loop.call_soon_threadsafe(_set_result, future, to_generations(output, version))

    def _admit(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for request_id, prompt, params, lora, lora_request, loop, future in inbox:
            self._futures[request_id] = (loop, future, lora)
            try:
                self._engine.add_request(request_id, prompt, params, lora_request=lora_request)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only its caller
                self._futures.pop(request_id)
                loop.call_soon_threadsafe(_set_exception, future, exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._error = exc
        with self._lock, self._inbox_lock:
            waiting = [(loop, future) for loop, future, _ in self._futures.values()]
            waiting += [(e[5], e[6]) for e in self._inbox]
            self._futures.clear()
            self._inbox.clear()
        for loop, future in waiting:
            loop.call_soon_threadsafe(_set_exception, future, RuntimeError(f"vLLM engine failed: {exc!r}"))

    def _drained(self) -> _Drained:
        return _Drained(self)

    def exclusive(self) -> _Drained:
        """Context for using ``self.llm`` directly (benchmarks): drains our requests and keeps the
        driver thread off the engine until exit (two threads stepping one LLMEngine corrupt it)."""
        return _Drained(self)

    @property
    def num_in_flight(self) -> int:
        return len(self._futures) + len(self._inbox)

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        """Reload HF-named base weights in place (or, with ``lora``, that adapter's PEFT tensors)."""
        with self._drained():
            if lora is not None:
                self._update_lora(lora, weights)
                self.lora_versions[lora] = version
            else:
                self.llm.collective_rpc(_reload_weights, args=(iter(weights),))
                self._weights_valid = True
                self.weight_version = version
            self._engine.reset_prefix_cache()

    def flush_cache(self) -> None:
        with self._drained():
            self._engine.reset_prefix_cache()

    def weight_bytes(self) -> int:
        """Bytes of parameter storage held by the worker (0 after ``sleep(level=2)`` on CPU). vLLM-CPU's
        packed linear weights are not parameters and are not counted."""
        with self._lock:
            return self.llm.collective_rpc(_weight_bytes)[0]

    # -- LoRA ------------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, path: Path, *, replica: int, seed: int, lora=None, num_threads: int = 0
    ):
        """Falls back to the ``hf`` engine when the vllm package is not installed (logged), so one
        config runs on a laptop without vLLM and on a GPU node with it."""
        if importlib.util.find_spec("vllm") is None:
            print("[megamarl] engine.backend=vllm but vllm is not installed: using the hf engine", flush=True)
            return HFEngine.from_config(cfg, path, replica=replica, seed=seed, num_threads=num_threads)
        lora_kwargs = (
            {"enable_lora": True, "max_loras": max(lora.num_adapters, 1), "max_lora_rank": lora.vllm_max_rank}
            if lora
            else {}
        )
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[resolve_dtype(cfg.dtype)]
        memory: dict[str, Any] = (
            {}
            if cfg.gpu_memory_utilization is None
            else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        )
        kv_cache_gib = cfg.kv_cache_setting(on_gpu=torch.cuda.is_available())  # 0: vLLM's fraction sizes it
        return cls(
            path,
            seed=seed,
            kv_cache_bytes=int(kv_cache_gib * 2**30) or None,
            dtype=dtype,
            num_threads=num_threads,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.eager(on_gpu=torch.cuda.is_available()),
            **memory,
            **lora_kwargs,
        )

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register a PEFT adapter directory under ``name`` (loaded on first use)."""
        from vllm.lora.request import LoRARequest

        if not self.enable_lora:
            raise ValueError("add_lora needs VLLMEngine(enable_lora=True)")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(
                f"LoRA '{name}': {path} is not a PEFT adapter directory (no adapter_config.json)"
            )
        lora_id = self._loras[name].lora_int_id if name in self._loras else len(self._loras) + 1
        self._loras[name] = LoRARequest(name, lora_id, str(path))
        self.lora_versions[name] = 0

    def _lora_request(self, name: str | None):
        if name is None:
            return None
        if name not in self._loras:
            raise ValueError(f"unknown LoRA adapter '{name}'; registered: {sorted(self._loras) or 'none'}")
        return self._loras[name]

    def _update_lora(self, name: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        current = self._lora_request(name)
        target = self._lora_dir / name / f"v{self._next_id}-{time.monotonic_ns()}"
        target.mkdir(parents=True)
        shutil.copy(Path(current.lora_path) / "adapter_config.json", target / "adapter_config.json")
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in weights},
            str(target / "adapter_model.safetensors"),
        )
        self._engine.add_lora(LoRARequest(name, current.lora_int_id, str(target), load_inplace=True))
        self._loras[name] = LoRARequest(name, current.lora_int_id, str(target))

    # -- lifecycle -------------------------------------------------------------------------------

    def sleep(self, *, level: int = 1) -> None:
        """Level 1: release KV cache (GPU: offload weights; CPU: its pages go back to the kernel).
        Level 2: also discard weights."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._awake.close()
        with self._drained():
            if self.native_sleep:
                self.llm.sleep(level=level)
            else:
                self._engine.reset_prefix_cache()
                self.llm.collective_rpc(_drop_kv_cache_pages)
                if level == 2:
                    self.llm.collective_rpc(_discard_weights)
                release_cached_memory()  # what the rollout freed leaves RSS before the update allocates
            if level == 2:
                self._weights_valid = False
                self.weight_version = -1  # holds no version: the next push is a full one (delta_sync)

    def wake(self) -> None:
        with self._lock:
            if self.native_sleep:
                self.llm.wake_up()
            else:
                self.llm.collective_rpc(_restore_weight_storage)
        self._awake.open()

    def health(self) -> bool:
        return self._error is None and not self._stopped and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._fail_all(RuntimeError("engine shut down"))
        with self._lock, VLLM_WORLD.active():  # vLLM destroys its (private) world on shutdown
            _LIVE_ENGINES.discard(id(self))
            core = getattr(self._engine, "engine_core", None)
            if _LIVE_ENGINES:
                # vLLM's shutdown destroys process-wide state (its model-parallel groups) that this
                # process's other engines still use ("pipeline model parallel group is not
                # initialized" in their next step): drop this engine's objects, leave the teardown to the last
                self.llm = self._engine = None
                gc.collect()
            elif core is not None and hasattr(core, "shutdown"):
                core.shutdown()


class _Drained:
    """Context: hold admission, wait until no request runs, keep the engine lock inside."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        engine._hold = True
        while True:
            engine._lock.acquire()
            if not engine._engine.has_unfinished_requests():
                return
            engine._lock.release()
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.engine._hold = False
        self.engine._lock.release()
        self.engine._wakeup.set()
