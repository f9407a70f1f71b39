"""Run megatron-core on CPU ranks over gloo.

megatron-core assumes CUDA in a handful of places that the CPU forward/backward path touches:
``torch.cuda.current_device()`` as a device argument, ``torch.cuda`` RNG calls in the tensor-parallel
RNG tracker, ``torch.cuda.synchronize`` in p2p communication, ``device="cuda"`` scalars in the
pipeline schedules and in the optimizers (``optimizer.py``, ``clip_grads.py``, ``distrib_optimizer.py``
and the multi-tensor fallbacks in ``megatron.core.utils``), the side stream of the MoE alltoall token
dispatcher (``torch.cuda.Stream`` for its device-to-host copies), and the optimizers' ``param.type()``
checks, which accept only ``torch.cuda.*Tensor`` names. On a machine without CUDA those calls raise, so this
module redirects exactly them to their CPU equivalents. It is inert when CUDA is present:
``enable_cpu_compat`` returns an empty list and patches nothing (megatron-core then runs unmodified on GPUs).

Each patch is listed by name in ``PATCHES`` so tests can check exactly what was (or was not) changed;
``patches_in_force`` reads the patched objects themselves (the GPU tier asserts it is empty on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable

import torch

_APPLIED: list[str] = []


def _cpu_device(*_args, **_kwargs) -> str:
    return "cpu"


def _cpu_get_rng_state(device="cuda", *_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that one calls torch.cuda.manual_seed_all itself.
    torch.default_generator.manual_seed(int(seed))


class _CudaToCpuTorch(types.ModuleType):
    """``torch`` as seen by the pipeline schedules: tensors asked for on "cuda" are made on CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory):
        @functools.wraps(factory)
        def wrapped(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return factory(*args, device=device, **kwargs)

        return wrapped

    @property
    def zeros(self):
        return self._on_cpu(torch.zeros)

    @property
    def ones(self):
        return self._on_cpu(torch.ones)

    @property
    def tensor(self):
        return self._on_cpu(torch.tensor)

    @property
    def empty(self):
        return self._on_cpu(torch.empty)


class _CpuStream:
    """The one stream a CPU has: work is done when issued, so waits and events are no-ops."""

    def wait_stream(self, _stream) -> None:
        pass

    def record_event(self) -> _CpuStream:
        return self  # an event already reached

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuStreamsTorch(_CudaToCpuTorch):
    """``torch`` as seen by the MoE token dispatcher: ``torch.cuda``'s streams are the CPU's one stream
    (the dispatcher's side stream is then the current one, so it records no tensor on it)."""

    class _Cuda(types.ModuleType):
        def __init__(self):
            super().__init__("torch.cuda")

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def Stream(*_args, **_kwargs) -> _CpuStream:  # torch.cuda's name
            return _CPU_STREAM

        @staticmethod
        def current_stream(*_args, **_kwargs) -> _CpuStream:
            return _CPU_STREAM

        @staticmethod
        def stream(_stream):
            return contextlib.nullcontext()

    cuda = _Cuda()


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    # torch.manual_seed seeds "all CUDA devices" after the CPU one: there are none.
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.random.get_rng_state = _cpu_get_rng_state
    # ``tensor.cuda()`` (e.g. LanguageModule.setup_embeddings_and_output_layer with tied embeddings
    # and PP>1) keeps the tensor where it is: on a CUDA-less machine the only device is the CPU.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _patch_tp_random() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _cpu_get_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_rng_state


def _patch_schedules() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CudaToCpuTorch()


def _patch_optimizers() -> None:
    import sys

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for module in (optimizer, clip_grads, distrib_optimizer, utils):
        module.torch = _CudaToCpuTorch()
    # ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` decides which
    # parameters get fp32 main copies: answer with the CUDA name, for the optimizer modules only.
    optimizer_modules = {optimizer.__name__, clip_grads.__name__, distrib_optimizer.__name__}
    tensor_type = torch.Tensor.type

    def type_as_cuda(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        if (
            not args
            and not kwargs
            and name.startswith("torch.")
            and not name.startswith("torch.cuda.")
            and sys._getframe(1).f_globals.get("__name__") in optimizer_modules
        ):
            return "torch.cuda." + name[len("torch.") :]
        return name

    torch.Tensor.type = type_as_cuda


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` on a CPU: the split sizes the GPU path hands to
    ``all_to_all_single`` are numpy arrays (its device-to-host copies); a CPU tensor stays a tensor
    there, which c10d's ``all_to_all_single`` refuses as a split-size list."""
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


def _patch_token_dispatcher() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.torch = _CpuStreamsTorch()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy


# name -> what it redirects; applied in this order.
PATCHES: dict[str, Callable[[], None]] = {
    "torch.cuda (current_device, synchronize, rng), Tensor.cuda": _patch_torch_cuda,
    "megatron.core.tensor_parallel.random (_get/_set_cuda_rng_state)": _patch_tp_random,
    "megatron.core.pipeline_parallel.schedules (device='cuda' tensors)": _patch_schedules,
    "megatron.core.optimizer (device='cuda' tensors, CUDA tensor type names), utils": _patch_optimizers,
    "megatron.core.transformer.moe.token_dispatcher (torch.cuda streams, host split sizes)": (
        _patch_token_dispatcher
    ),
}


# name -> whether that patch is in force, read from the objects it replaces (not from ``_APPLIED``).
def _torch_cuda_patched() -> bool:
    return torch.cuda.current_device is _cpu_device or torch.cuda.get_rng_state is _cpu_get_rng_state


def _tp_random_patched() -> bool:
    from megatron.core.tensor_parallel import random as tp_random

    return tp_random._get_cuda_rng_state is _cpu_get_rng_state


def _schedules_patched() -> bool:
    from megatron.core.pipeline_parallel import schedules

    return isinstance(schedules.torch, _CudaToCpuTorch)


def _optimizers_patched() -> bool:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    return (
        any(isinstance(m.torch, _CudaToCpuTorch) for m in (optimizer, clip_grads, distrib_optimizer, utils))
        or torch.Tensor.type.__name__ == "type_as_cuda"
    )


def _token_dispatcher_patched() -> bool:
    from megatron.core.transformer.moe import token_dispatcher

    return (
        isinstance(token_dispatcher.torch, _CpuStreamsTorch)
        or token_dispatcher.maybe_move_tensor_to_cpu is _host_copy
    )


_PROBES: dict[str, Callable[[], bool]] = dict(
    zip(
        PATCHES,
        (
            _torch_cuda_patched,
            _tp_random_patched,
            _schedules_patched,
            _optimizers_patched,
            _token_dispatcher_patched,
        ),
        strict=True,
    )
)


def patches_in_force() -> list[str]:
    """The names of ``PATCHES`` whose replacement is in force in this process, found by looking at
    the patched objects (``torch.cuda``, megatron-core's modules); empty where megatron-core runs unmodified.
    """
    return [name for name, probe in _PROBES.items() if probe()]


def cpu_compat_needed() -> bool:
    return not torch.cuda.is_available()


def enable_cpu_compat() -> list[str]:
    """Apply every patch once when CUDA is absent; return the names of the patches in force."""
    if not cpu_compat_needed():
        return []
    for name, patch in PATCHES.items():
        if name not in _APPLIED:
            patch()
            _APPLIED.append(name)
    return list(_APPLIED)
