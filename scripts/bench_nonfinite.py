"""The per-step gradient check before an update, old and new, on this machine's CPU: ``isfinite(buffer).all()``
per DDP buffer, each read back to the host (before), against ``optimizer.nonfinite`` (one fp32 sum per
buffer, one flag read). Prints seconds per check for fp32 and bf16 buffers of ``--numel`` elements."""

from __future__ import annotations

import argparse
import json
import time

import torch

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
    args = parser.parse_args()
    out = {"threads": torch.get_num_threads(), "numel_per_buffer": args.numel, "num_buffers": 2}
    for dtype in (torch.float32, torch.bfloat16):
        buffers = [torch.randn(args.numel).to(dtype) for _ in range(2)]
        assert old_check(buffers) and new_check(buffers)
        buffers[1][123] = float("nan")
        assert not old_check(buffers) and not new_check(buffers)
        buffers[1][123] = 0.0
        old, new = best_of(old_check, buffers, args.repeats), best_of(new_check, buffers, args.repeats)
        out[str(dtype)] = {"old_s": round(old, 5), "new_s": round(new, 5), "speedup": round(old / new, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
