"""One policy update's forward+backward in fp32 vs bf16 autocast on this node, side by side.

    python scripts/bench_train_dtype.py [--model smollm2-135m-instruct] [--threads 1] [--repeats 2]

Builds the policy's Megatron worker group on one rank (the same ``PolicyWorker`` the trainer uses),
runs ``backward`` on a fixed batch (16 samples x 70 prompt + 20 response tokens) alternately with
``compute_dtype`` fp32 and bf16 (``policies.<p>.dtype``), and reports the best time of each, their
ratio and the relative gradient difference. Prints a table and writes ``docs/bench/train_dtype.json``
with the machine (CPU flags: bf16 is fast only where native) and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megamarl.config import PolicyConfig  # noqa: E402
from megamarl.parallel.distributed import init_distributed  # noqa: E402
from megamarl.parallel.hardware import cpu_flags, native_bf16  # noqa: E402
from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups  # noqa: E402
from megamarl.rl.batch import collate  # noqa: E402
from megamarl.rl.losses import LossConfig, loss_counts  # noqa: E402
from megamarl.rl.policy_setup import load_policy_model  # noqa: E402
from megamarl.rl.sample import Sample  # noqa: E402
from megamarl.rl.worker import PolicyWorker  # noqa: E402


def _batch(num: int = 16, prompt_len: int = 70, response_len: int = 20):
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(task_id=f"t{i % 4}", episode_id=f"e{i}", agent="solver", policy="p", turn=0,
               prompt_ids=torch.randint(0, 49152, (prompt_len,), generator=g).tolist(),
               response_ids=torch.randint(0, 49152, (response_len,), generator=g).tolist(),
               rollout_logprobs=(-torch.rand(response_len, generator=g) * 3).tolist())
        for i in range(num)
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.randn(num, generator=g))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a torchrun rank has 1)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    init_distributed()
    torch.set_num_threads(args.threads)
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    policy = PolicyConfig(model=args.model, micro_batch_size=16, lr=1e-5, grad_clip=0.0)
    worker = PolicyWorker("p", policy, wg, load_policy_model(policy, wg, seed=0), LossConfig())
    batch = _batch()
    counts = loss_counts(batch.response_mask)
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    grads = {}
    for _ in range(args.repeats):
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            worker.compute_dtype = dtype
            start = time.perf_counter()
            worker.backward(batch, None, counts)
            seconds[name].append(time.perf_counter() - start)
            grads[name] = {i: p.main_grad.clone() for i, p in enumerate(worker.params)}  # DP-reduced, fp32
    diff = sum((grads["fp32"][n] - grads["bf16"][n]).double().pow(2).sum() for n in grads["fp32"]).sqrt()
    norm = sum(g.double().pow(2).sum() for g in grads["fp32"].values()).sqrt()
    best = {k: min(v) for k, v in seconds.items()}
    result = {
        "model": args.model, "threads": args.threads, "batch": "16 x (70 prompt + 20 response) tokens",
        "seconds_best": {k: round(v, 3) for k, v in best.items()},
        "seconds_all": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
        "fp32_over_bf16": round(best["fp32"] / best["bf16"], 2),
        "relative_grad_diff": round(float(diff / norm), 4),
        "machine": {"native_bf16": native_bf16(), "avx512_bf16": "avx512_bf16" in cpu_flags(),
                    "amx_bf16": "amx_bf16" in cpu_flags(), "cores": os.cpu_count()},
        "load_avg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }
    out = ROOT / "docs" / "bench" / "train_dtype.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'dtype':<6} {'best s':>8}   (fwd+bwd, {args.model}, {result['batch']}, {args.threads} thread(s))")
    for name in ("fp32", "bf16"):
        print(f"{name:<6} {best[name]:>8.2f}")
    print(f"fp32/bf16 = {result['fp32_over_bf16']}x, relative gradient difference {result['relative_grad_diff']}, "
          f"native bf16: {native_bf16()}, load {load_before:.1f} -> {result['load_avg_1min']['after']:.1f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
