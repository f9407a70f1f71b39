"""The per-step gradient check before an update, old and new, on this machine's CPU:
``isfinite(buffer).all()`` per DDP buffer, each read back to the host (before), against
``optimizer.nonfinite`` (one fp32 sum per buffer, one flag read). Prints a table of seconds per check for fp32
and bf16 buffers of ``--numel`` elements, side by side in one run, and writes it with the machine and its load
to ``--out``.

    python scripts/bench_nonfinite.py [--numel 33554432] [--out docs/bench/nonfinite.json]"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from bench_rollout import machine_info  # scripts/ is on sys.path when run as a script

from megamarl.rl.optimizer import nonfinite


def old_check(buffers) -> bool:
    return all(bool(torch.isfinite(b).all()) for b in buffers)


def new_check(buffers) -> bool:
    return nonfinite(buffers, device=torch.device("cpu")).item() == 0.0


def best_of(fn, buffers, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(buffers)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=32 * 2**20, help="elements per buffer (two buffers)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/bench/nonfinite.json")
    args = parser.parse_args()
    out = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "numel_per_buffer": args.numel,
        "num_buffers": 2,
    }
    for dtype in (torch.float32, torch.bfloat16):
        buffers = [torch.randn(args.numel).to(dtype) for _ in range(2)]
        assert old_check(buffers) and new_check(buffers)
        buffers[1][123] = float("nan")
        assert not old_check(buffers) and not new_check(buffers)
        buffers[1][123] = 0.0
        old, new = best_of(old_check, buffers, args.repeats), best_of(new_check, buffers, args.repeats)
        out[str(dtype)] = {"old_s": round(old, 5), "new_s": round(new, 5), "speedup": round(old / new, 2)}
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(f"{'buffers':<16}{'isfinite().all() s':>20}{'one sum s':>12}{'ratio':>8}")
    for dtype in ("torch.float32", "torch.bfloat16"):
        row = out[dtype]
        print(f"{'2 x ' + dtype[6:]:<16}{row['old_s']:>20.4f}{row['new_s']:>12.4f}{row['speedup']:>7.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
