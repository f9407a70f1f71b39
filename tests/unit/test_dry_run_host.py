"""The dry-run of a CPU config: RAM per rank, hand-checked, against this host's; no GPU wording."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from rich.console import Console

from megamarl.cli.configure import load_config
from megamarl.driver.schedules import overlaps_training
from megamarl.parallel.hardware import HostMemory, host_memory
from megamarl.planning.dryrun import GIB, dry_run
from megamarl.planning.host_report import CPU_RANK_BASELINE_BYTES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# A 1-layer Llama: h 8, 2 heads of 4 (q = kv = 8), ffn 16, vocabulary 128, tied embeddings.
TINY = {
    "num_hidden_layers": 1,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 16,
    "vocab_size": 128,
    "tie_word_embeddings": True,
}
# parameters: qkv 8*24 + proj 8*8 + fc1 16*2*8 + fc2 16*8 = 640, 2 norms 16, embedding 128*8 = 1024,
# final norm 8: 1688, all fp32 (the local spec's norms are fp32 too), one DDP buffer, no padding
# (distributed_optimizer: false)
PARAMS = 640 + 16 + 1024 + 8
WEIGHTS = GRADS = 4 * PARAMS  # 6,752 B each
ADAM = 2 * 4 * PARAMS  # fp32 parameters are stepped in place: no main copy; two fp32 moments
# activations, local spec, recompute none, 1 row of seq_len 4 (b = 4 bytes), per token of the layer:
# norms 2 * (8h + bh + 4) = 200, attention 3bq + scores 4 * 2 heads * 4 + bq = 160, MLP 5bf = 320;
# x 4 tokens + the fp32 rotary table 4 * 4 * 4 * 4 = 256 -> 2,976; token ids 8 * 4 = 32; final norm and
# output input (8h + bh + 4 - bh) * 4 + bh * 4 = 400; the [4, 4] bool mask 16
SAVED = (200 + 160 + 320) * 4 + 256 + 32 + 400 + 16  # 3,424
LOGITS = (4 + 24) * 4 * 128  # (b + 24) * rows * vocabulary = 14,336
ENGINE = 4 * PARAMS + GIB // 4  # fp32 engine weights + engine.kv_cache_gib 0.25
RANK = CPU_RANK_BASELINE_BYTES + WEIGHTS + GRADS + ADAM + SAVED + LOGITS + ENGINE


def _tiny_config(tmp_path: Path, *overrides: str):
    model = tmp_path / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(TINY))
    return load_config(
        CONFIGS / "signalling_tiny.yaml",
        [
            f"policies.shared.model={model}",
            "policies.shared.micro_batch_size=1",
            "policies.shared.seq_len=4",
            "policies.shared.distributed_optimizer=false",
            "policies.shared.engine.kv_cache_gib=0.25",
            *overrides,
        ],
    )


def _dry_run(cfg, host: HostMemory):
    console = Console(file=io.StringIO(), width=250)
    report = dry_run(cfg, overlaps_training=overlaps_training(cfg.trainer), console=console, host=host)
    return report, console.file.getvalue()


def test_cpu_report_prices_each_rank_by_hand(tmp_path):
    cfg = _tiny_config(tmp_path)
    report, out = _dry_run(cfg, HostMemory(total=16 * GIB, available=8 * GIB))
    assert report.world_size == 1 and not report.on_gpus
    (rank,) = report.gpus
    train = rank.phases["train"].kinds
    assert train == {
        "weights": WEIGHTS,
        "grads": GRADS,
        "main_params": 0.0,
        "optimizer": ADAM,
        "reference": 0.0,
        "activations": SAVED + LOGITS,
        "engine_weights": 4 * PARAMS,  # the in-process engine sleeps: its KV cache is released
        "nccl": 0.0,
        "reserve": CPU_RANK_BASELINE_BYTES,  # the process baseline, not cluster.reserved_gib
    }
    # CPU ranks do not offload; the in-process engine's KV cache is held from its wake to its sleep
    with_kv = {"re-sync restarted", "rollout", "wake kv cache", "evaluate"}
    assert {name for name, p in rank.phases.items() if p.kinds.get("kv_cache") == GIB // 4} == with_kv
    assert {p.total for name, p in rank.phases.items() if name in with_kv} == {RANK - SAVED - LOGITS}
    assert {p.total for name, p in rank.phases.items() if name not in with_kv | {"train"}} == {
        RANK - SAVED - LOGITS - GIB // 4
    }
    assert rank.phases["train"].total == RANK - GIB // 4
    assert rank.peak_phase == "re-sync restarted" and rank.total == RANK - SAVED - LOGITS  # 0.81 GiB
    assert "Ranks (RAM, GiB" in out and "Worker groups (1 CPU ranks; GiB per rank)" in out
    assert (
        "peak 0.8 GiB on rank 0 (phase 're-sync restarted'); ranks 0 need 0.8 GiB together (phase 're-sync "
        "restarted') of this host's 16.0 GiB RAM (MemTotal, /proc/meminfo; 8.0 GiB MemAvailable now)"
        in out.replace("\n", " ")
    )
    assert "GPU" not in out and "reserve" not in out and "capacity" not in out


def test_cpu_ranks_that_need_more_than_the_host_are_warned_naming_the_numbers(tmp_path):
    """A warning, not an error: the CPU plan is pessimistic (prefix trees priced unshared)."""
    cfg = _tiny_config(tmp_path)
    _, out = _dry_run(cfg, HostMemory(total=GIB // 2, available=GIB // 4))
    assert re.search(
        r"warning: policies\.shared: CPU ranks 0 need 0\.8 GiB of RAM together in phase "
        r"'re-sync restarted' > "
        r"this host's 0\.5 GiB \(MemTotal, /proc/meminfo\)",
        " ".join(out.split()),
    ), out


def test_a_default_seq_len_far_above_the_replies_is_named(tmp_path):
    cfg = _tiny_config(tmp_path, "policies.shared.seq_len=2048")  # the default, replies of 1 token
    _, out = _dry_run(cfg, HostMemory(total=1024 * GIB, available=1024 * GIB))
    assert (
        "note: policies.shared.seq_len=2048 (the default) prices every sample of shared at 2048 tokens" in out
    )
    cfg = _tiny_config(tmp_path / "set")  # seq_len set: no note
    assert "note: policies" not in _dry_run(cfg, HostMemory(total=GIB, available=GIB))[1]


def test_quickstart_dry_run_fits_this_kind_of_host():
    """README command 1's config: what each rank holds (bf16 or fp32 by the host), under 24 GiB together."""
    cfg = load_config(CONFIGS / "quickstart_cpu.yaml")
    report, out = _dry_run(cfg, HostMemory(total=24 * GIB, available=24 * GIB))
    busy = [g for g in report.gpus if g.phases]
    assert [g.rank for g in busy] == [0, 1]
    assert sum(g.total for g in busy) < 16 * GIB
    assert "GPU" not in out and "note: policies" not in out


def test_host_memory_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12288000 kB\n")
    assert host_memory(str(meminfo)) == HostMemory(24576000 * 1024, 12288000 * 1024)
    assert host_memory(str(tmp_path / "absent")) is None
