"""``scripts/bench_train.py --quick`` (tiny-random-llama, 6 samples, one rank) runs end to end and
writes the JSON that docs/performance.md quotes: the three variants with their dtypes, optimizer,
padding, timings, FLOP/s and ratios, the matmul peaks, the machine and the load; and the shared-prefix
part (packed vs tree on the quickstart and multi-turn batch shapes) that docs/rl.md quotes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script  # tests/ helper

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VARIANT_KEYS = {
    "label",
    "optimizer",
    "param_dtype",
    "main_param_dtype",
    "padding_fraction",
    "num_micro_batches",
    "micro_batch_shapes",
    "recomputes_old_logprobs",
    "seconds_best",
    "seconds_all",
    "warmup_s",
    "tokens_per_s",
    "useful_flops",
    "useful_flops_per_s",
    "fraction_of_matmul_peak",
    "speedup_vs_fp32_padded",
    "load_1min_after_each",
    "cpu_seconds_best",
    "tokens_per_cpu_s",
    "fraction_of_matmul_peak_cpu",
    "speedup_vs_fp32_padded_cpu",
}


def test_quick_run_writes_the_result(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp32_padded" in proc.stdout and "tokens/s" in proc.stdout
    result = json.loads(out.read_text())

    assert result["model"] == "tiny-random-llama" and result["repeats"] >= 3
    variants = result["variants"]
    assert list(variants) == ["fp32_padded", "bf16_padded", "bf16_packed"]
    for name, v in variants.items():
        assert VARIANT_KEYS <= set(v), (name, VARIANT_KEYS - set(v))
        assert len(v["seconds_all"]) == result["repeats"] and v["seconds_best"] == min(v["seconds_all"]) > 0
        assert v["tokens_per_s"] == pytest.approx(result["batch"]["num_tokens"] / v["seconds_best"], rel=1e-2)
        assert v["main_param_dtype"] == "torch.float32"  # Adam updates fp32 main params in every variant
        assert v["recomputes_old_logprobs"] is False  # ppo_epochs=1, one mini-batch: no extra forward
        assert 0 < v["fraction_of_matmul_peak"]
    assert variants["fp32_padded"]["param_dtype"] == "torch.float32"
    assert (
        variants["bf16_padded"]["param_dtype"] == variants["bf16_packed"]["param_dtype"] == "torch.bfloat16"
    )
    assert variants["fp32_padded"]["speedup_vs_fp32_padded"] == 1.0
    # variable lengths: padded micro-batches carry padding, packed ones none, and all see the same FLOPs
    assert variants["bf16_padded"]["padding_fraction"] == variants["fp32_padded"]["padding_fraction"] > 0
    assert variants["bf16_packed"]["padding_fraction"] == 0.0
    assert all(rows == 1 for rows, _ in variants["bf16_packed"]["micro_batch_shapes"])
    assert len({v["useful_flops"] for v in variants.values()}) == 1
    assert (
        sum(length for _, length in variants["bf16_packed"]["micro_batch_shapes"])
        == result["batch"]["num_tokens"]
    )

    for key in ("matmul_peak_flops_per_s", "matmul_peak_flops_per_cpu_s"):
        assert set(result[key]) == {"fp32", "bf16"} and all(x > 0 for x in result[key].values())
    assert {"cpu_model", "cores", "avx512_bf16", "amx_bf16", "native_bf16"} <= set(result["machine"])
    assert len(result["load_avg"]["before"]) == len(result["load_avg"]["after"]) == 3
    assert {"torch", "megatron_core"} <= set(result["versions"])
    assert "6*N_body*T" in result["flops_formula"]

    # shared prefixes (issue 43): packed vs tree on the quickstart and multi-turn shapes, one process each
    part = result["shared_prefix"]
    assert list(part["batches"]) == ["quickstart", "multiturn"] and part["scale"] == 0.25
    for shape, entry in part["batches"].items():
        packed, tree = entry["packed"], entry["tree"]
        assert packed["samples"] == tree["samples"] and packed["sample_tokens"] == tree["sample_tokens"]
        assert packed["forwarded_tokens"] == packed["sample_tokens"], shape  # unshared: every sample token
        assert tree["forwarded_tokens"] < 0.6 * packed["forwarded_tokens"], (shape, entry)  # prompts once
        assert (
            tree["attended_pairs"] < packed["attended_pairs"] and tree["model_flops"] < packed["model_flops"]
        )
        assert entry["tree_over_packed"]["forwarded_tokens"] == round(
            tree["forwarded_tokens"] / packed["forwarded_tokens"], 3
        )
        assert all(v["seconds"] > 0 and v["peak_rss_gib"] > 0 for v in (packed, tree))
    assert "shared prefixes" in proc.stdout and "tree/packed" in proc.stdout


def test_random_weights_build_the_preset_architecture(tmp_path, monkeypatch):
    """``--random-weights`` (GPU nodes without the packaged model): ``--model``'s preset shape, random
    weights, no tokenizer; the Megatron bridge reads it back as that shape."""
    from megamarl.planning import model_presets

    # its dataclasses look their module up in sys.modules
    bench = load_script(
        "scripts/bench_train.py", before_exec=lambda m: monkeypatch.setitem(sys.modules, "bench_train", m)
    )
    shapes = {
        "tiny-gqa": model_presets.ModelShape(2, 64, 4, 2, 96, 320, tied_embeddings=True),
        "tiny-qwen3": model_presets.ModelShape(2, 64, 4, 2, 96, 320, head_dim=32, qk_norm=True),
    }
    monkeypatch.setattr(model_presets, "PRESETS", shapes)
    for name, shape in shapes.items():
        path = bench.random_weights_model(name, tmp_path / name)
        assert model_presets.resolve_model_shape(path) == shape, name
        assert not (tmp_path / name / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="architecture preset"):
        bench.random_weights_model("no-such-model", tmp_path / "x")
