"""Prefix-tree packing vs the unshared packed update (issue 43): one policy update of the packaged
SmolLM2-135M on two batch shapes, side by side in one run.

    python scripts/bench_tree.py                 # both batches, fp32, ~10 CPU minutes on an AVX2 core
    python scripts/bench_tree.py --quick         # smoke run: tiny-random-llama, small batches

Batches (token ids random, the sharing structure that of the runs they stand for):

- ``quickstart``: README command 1's update (``configs/quickstart_cpu.yaml``): 4 tasks x a group of 8;
  a task's 8 solver rows share their ~90-token prompt before <= 24 reply tokens, its 8 verifier rows
  share the verifier's prompt (system turn + question, ~80 tokens) before the solver's answer they
  judge and their <= 8-token reply; the two agents' system turns differ, so they share nothing;
- ``multiturn``: a team of 2 agents x 4 turns with ``multi_turn`` transcripts, 4 episodes per task
  (a group), 2 tasks: turn t's prompt is turn t-1's prompt and reply plus a 20-token observation, so
  each later turn contains the earlier ones whole.

Variants: ``padded`` (the default: rows padded to the micro-batch's longest), ``packed`` (``pack:
true``) and ``tree`` (``pack: true, prefix_tree: true``), the same ``micro_batch_size`` and token
budget, fp32 (the dtype ``auto`` picks on CPUs without native bf16).
Each variant runs in its own process (its own peak RSS), one warm-up update on the batch's first row
then ``--repeats`` timed updates of the whole batch; the best counts, wall and CPU seconds. Reported:
tokens forwarded per pass (sample tokens vs trie nodes), model FLOPs of one forward+backward
(``6 N_body tokens + 6 d V R + 12 L d P``: ``P`` the attended (query, key) pairs of the layout, so
the shared prefixes' attention counts once too; padded: its real tokens), seconds, peak RSS, and
each variant's ratios to the first one run (``--variants``; default ``packed tree``).
Writes ``--out`` (default ``docs/bench/tree.json``) with the machine and the load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("padded", "packed", "tree")


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


def make_batch(shape: str, vocab: int, scale: float):
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

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
    """(tokens, attended query-key pairs) of one micro-batch in the variant's layout."""
    from megamarl.rl.tree import tree_pack

    if worker.cfg.prefix_tree:
        tree = tree_pack(mb.tokens, mb.attention_mask)
        return tree.num_tokens, int(
            (tree.position_ids + 1).sum()
        )  # a node attends to itself and its ancestors
    if not worker.cfg.pack:  # padded: every row computed to the micro-batch's width
        rows, width = mb.tokens.shape
        return rows * width, rows * width * (width + 1) // 2
    lengths = mb.lengths.tolist()
    return int(sum(lengths)), int(sum(n * (n + 1) // 2 for n in lengths))


def child(args) -> dict:
    """One variant in this process: build, warm up, time ``--repeats`` updates."""
    from megamarl.config import PolicyConfig
    from megamarl.parallel.distributed import init_distributed
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    init_distributed()
    torch.set_num_threads(args.threads)
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    packing = {
        "pack": True,
        "prefix_tree": args.variant == "tree",
        "max_tokens_per_micro_batch": args.max_tokens,
    }
    policy = PolicyConfig(
        model=args.model,
        micro_batch_size=args.micro_batch_size,
        lr=1e-6,
        dtype="fp32",
        **(packing if args.variant != "padded" else {}),
    )
    handle = load_policy_model(policy, wg, seed=0, dtype=torch.float32)
    worker = PolicyWorker("p", policy, wg, handle, LossConfig())
    batch = make_batch(args.batch, handle.vocab_size, args.scale)
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
    for _ in range(args.repeats):
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
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def machine() -> dict:
    from megamarl.parallel.hardware import cpu_flags, native_bf16

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "native_bf16": native_bf16(),
        "avx512": any(f.startswith("avx512") for f in cpu_flags()),
        "torch": torch.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--batches", nargs="+", default=["quickstart", "multiturn"], choices=["quickstart", "multiturn"]
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=16, help="rows per micro-batch (the quickstart's)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=2048, help="tokens per micro-batch (tree: trie nodes)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a torchrun rank has 1)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every length of the batch shapes"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny-random-llama, lengths x 0.25")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["packed", "tree"],
        choices=VARIANTS,
        help="variants to run, the first the reference of the ratios",
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one child process
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.scale, args.repeats = "tiny-random-llama", 0.25, 1
    if args.variant:
        print(json.dumps(child(args)))
        return 0
    out = args.out or (
        Path(tempfile.gettempdir()) / "megamarl_bench_tree_quick.json"
        if args.quick
        else ROOT / "docs" / "bench" / "tree.json"
    )
    load_before, start = os.getloadavg(), time.perf_counter()
    results: dict = {}
    for batch in args.batches:
        results[batch] = {}
        for variant in args.variants:
            cmd = [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--batch",
                batch,
                "--model",
                args.model,
                "--micro-batch-size",
                str(args.micro_batch_size),
                "--max-tokens",
                str(args.max_tokens),
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
                "--scale",
                str(args.scale),
            ]
            print(f"{batch} / {variant} ...", file=sys.stderr, flush=True)
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if done.returncode:
                sys.stderr.write(done.stderr[-3000:])
                return done.returncode
            results[batch][variant] = json.loads(done.stdout.strip().splitlines()[-1])
        first = results[batch][args.variants[0]]
        for variant in args.variants[1:]:
            results[batch][f"{variant}_over_{args.variants[0]}"] = {
                k: round(results[batch][variant][k] / first[k], 3)
                for k in (
                    "forwarded_tokens",
                    "attended_pairs",
                    "model_flops",
                    "seconds",
                    "cpu_seconds",
                    "peak_rss_gib",
                )
            }
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_tree.py", *sys.argv[1:]]),
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_s": time.perf_counter() - start,
        "model": args.model,
        "micro_batch_size": args.micro_batch_size,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "scale": args.scale,
        "batches": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{'batch':<11} {'variant':<7} {'samples':>7} {'tokens':>7} {'pairs':>8} {'GFLOP':>7} {'wall s':>7} "
        f"{'CPU s':>7} {'RSS GiB':>7}"
    )
    for batch, entry in results.items():
        for variant in args.variants:
            v = entry[variant]
            print(
                f"{batch:<11} {variant:<7} {v['samples']:>7} {v['forwarded_tokens']:>7} "
                f"{v['attended_pairs']:>8} "
                f"{v['model_flops'] / 1e9:>7.1f} {v['seconds']:>7.1f} {v['cpu_seconds']:>7.1f} "
                f"{v['peak_rss_gib']:>7.2f}"
            )
        for variant in args.variants[1:]:
            r = entry[f"{variant}_over_{args.variants[0]}"]
            print(
                f"{batch:<11} {variant + '/' + args.variants[0][:3]:<7} {'':>7} {r['forwarded_tokens']:>7} "
                f"{r['attended_pairs']:>8} {r['model_flops']:>7} {r['seconds']:>7} {r['cpu_seconds']:>7} "
                f"{r['peak_rss_gib']:>7}"
            )
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
