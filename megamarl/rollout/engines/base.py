"""The engine protocol every rollout backend implements (vLLM, SGLang, HF, scripted test policies).

Token ids in, token ids and per-token logprobs out: prompts are never re-tokenized inside an
engine, so training sees exactly the tokens that were sampled. Weight updates arrive as an
iterator of (HF name, tensor) pairs, the same stream that ``megamarl.models`` exports from a
Megatron worker group, and each update stamps a new ``weight_version`` that every later
``Generation`` carries. LoRA adapters (L2) have their own versions: an adapter-only update
(``update_weights(..., lora=name)``) stamps ``lora_versions[name]``, which the generations of that
adapter carry; the base ``weight_version`` is left alone.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from megamarl.registry import Registry
from megamarl.rollout.engines.batching import AdmissionGate


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    # Constrained decoding (as vLLM's ``allowed_token_ids``): sample only among these tokens; the
    # returned logprobs are under that restricted distribution. Empty: no constraint.
    allowed_token_ids: tuple[int, ...] = ()
    # Stop strings (vLLM's ``stop``): generation ends after the token whose decoded text completes
    # one of them ("stop"). The tokens stay in the returned ids (they were sampled and are trained);
    # the agent cuts its reply text at the string (``Agent.response_text``).
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError(f"sampling.stop strings must be non-empty, got {list(self.stop)}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")


@dataclass
class Generation:
    """One sampled completion."""

    token_ids: list[int]
    # logprob of each sampled token under the distribution it was drawn from: log_softmax(logits / T)
    # renormalised to the top-k/top-p support (vLLM's "processed_logprobs"); T=0 (greedy) reports
    # log_softmax(logits). With top-k/top-p off this is the policy at the sampling temperature.
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    weight_version: int
    meta: dict = field(default_factory=dict)  # engine-specific extras (timings), logging only


class ServesAdapters(Protocol):
    """An engine that serves L2 adapters: the in-process engines with LoRA, the server clients, the pool."""

    def add_lora(self, name: str, path: str | Path) -> None: ...


class ServerReplica(ServesAdapters, Protocol):
    """A server client in a pool: it remembers the version of each adapter it loaded."""

    base_url: str
    lora_versions: dict[str, int]


class Engine(abc.ABC):
    """An inference engine serving one policy (optionally several LoRA adapters)."""

    weight_version: int = 0

    @abc.abstractmethod
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        """Return ``sampling.n`` completions of ``prompt_ids`` (concurrent calls are batched)."""

    @abc.abstractmethod
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        """Load HF-named tensors (full or adapter-only when ``lora`` names an adapter) and set
        ``weight_version``. Callers pause the engine first; the engine flushes caches after."""

    def sleep(self, *, level: int = 1) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Release memory while colocated training runs: level 1 frees the KV cache and offloads
        weights to host memory; level 2 also discards the weights (the next ``update_weights``
        must then carry all of them). Requests wait until ``wake``."""

    def wake(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Restore what ``sleep`` released."""

    def pause(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Stop admitting new requests; in-flight ones drain or are held."""

    def resume(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Admit requests again."""

    def flush_cache(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Drop cached prefixes/KV computed with older weights."""

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op unless the engine has the ability
        """Free resources; the engine is unusable afterwards."""

    @classmethod
    def from_config(
        cls, cfg: Any, path: Path, *, replica: int, seed: int, lora: Any = None, num_threads: int = 0
    ) -> Engine:
        """Replica ``replica`` of a policy's engine from its ``EngineConfig`` (``lora``: a
        ``rollout.engines.lora_backends.LoraServing`` when the policy serves L2 adapters; ``num_threads``: CPU
        threads of an in-process engine, 0: the process's setting). Engines registered with
        ``EngineTraits(configurable=True)`` implement it."""
        raise NotImplementedError(f"{cls.__name__} is not built from policies.<p>.engine")


class InProcessEngine(Engine):
    """An engine running in this process (``hf``, ``vllm``): requests wait, never fail, while it is
    paused (``pause``/``resume``) or asleep (``sleep``/``wake``). Subclasses call ``_admitted()``
    before taking a request, close ``_awake`` first thing in ``sleep`` and open it last in ``wake``.
    """

    def __init__(self) -> None:
        self._running = AdmissionGate()  # pause/resume
        self._awake = AdmissionGate()  # sleep/wake
        self.lora_versions: dict[str, int] = {}  # adapter -> version of its weights

    async def _admitted(self) -> None:
        await self._running.wait()
        await self._awake.wait()

    def pause(self) -> None:
        self._running.close()

    def resume(self) -> None:
        self._running.open()

    @property
    def is_sleeping(self) -> bool:
        return not self._awake.is_open

    def version_for(self, lora: str | None) -> int:
        """The version a generation with adapter ``lora`` (None: the base model) carries."""
        return self.weight_version if lora is None else self.lora_versions.get(lora, 0)


@dataclass(frozen=True)
class EngineTraits:
    """What the trainer and config validation need to know about an engine class.

    ``configurable``: built from ``policies.<p>.engine`` (``engine.backend`` may name it; the class
    implements ``from_config``); ``in_process``: runs inside the driver process; ``can_sleep``:
    ``sleep``/``wake`` release and restore memory (colocation); ``serves_lora``: L2 multi-adapter
    serving (``add_lora`` and adapter-only updates); ``external``: connects to servers listed in
    ``engine.server_urls`` (one per replica); ``server``: megamarl can start this backend as an
    inference server of its own (``rollout.servers.server_launch.server_command``; ``engine.launch=server``).
    """

    configurable: bool = False
    in_process: bool = False
    can_sleep: bool = False
    serves_lora: bool = False
    external: bool = False
    server: bool = False


ENGINES: Registry[type[Engine]] = Registry(
    "engine",
    traits=EngineTraits,
    signature="class(Engine); configurable: cls.from_config(cfg: EngineConfig, path, *, replica, seed, lora, "
    "num_threads)",
    keys=("policies.<name>.engine.backend",),
)


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor goes alone); with
    ``dtype``, floating tensors count at its size (they travel cast to it)."""
    bucket: list[tuple[str, torch.Tensor]]
    bucket, size = [], 0
    for name, tensor in named:
        itemsize = (
            dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        )
        nbytes = tensor.numel() * itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
