"""Engine servers, measured side by side in one run on this node (issue #14, item 7).

    python scripts/bench_servers.py [--model smollm2-135m-instruct] [--prompts 64] [--max-tokens 32]
                                    [--repeats 3] [--out docs/bench/servers.json]

Starts two real vLLM servers (``ServerProcess``, one CPU thread each, ``--enforce-eager``) and measures:

- **rollout**: the same prompts (chat-templated questions, ``--max-tokens`` each, temperature 1,
  all in flight at once) sent (a) straight to server 0 with one aiohttp session (``raw``), (b)
  through our ``EnginePool`` of ``VLLMServerClient`` with server 0 only (``pool x1``: our routing
  overhead is ``pool x1 / raw``) and (c) with both servers (``pool x2``). Tokens/s.
- **weight sync**: the model's full weights in the engine's dtype, ``--bucket-mb`` buckets:
  ``WeightSender`` over ``megamarl_gloo`` into 1 and into 2 servers (all receive each bucket at
  once), next to a raw ``ProcessGroupGloo`` broadcast of the same packed buckets from this
  process to 1 and to 2 plain receiver processes; then server 1 restarted with ``megamarl_shm``
  and fed through shared memory, next to a plain in-memory copy of the same bytes. GB/s; the
  figures are the ratios (target: gloo push >= 0.5 of the raw broadcast).

Seconds are the best of ``--repeats`` (the machine is shared); the table is printed and the JSON
holds the machine, its load and every repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_rollout import chat_prompts, machine_info  # noqa: E402

from megamarl.models.packaged import resolve_model_path  # noqa: E402
from megamarl.parallel.hardware import DTYPES, resolve_dtype  # noqa: E402
from megamarl.rollout.base import SamplingParams  # noqa: E402
from megamarl.rollout.pool import EnginePool  # noqa: E402
from megamarl.rollout.server_launch import ServerProcess, ServerSpec  # noqa: E402
from megamarl.rollout.server_sync import WeightSender, bucket_info, gloo_broadcast, new_gloo_group, pack_bucket  # noqa: E402
from megamarl.rollout.vllm_server import VLLMServerClient  # noqa: E402
from megamarl.rollout.weight_sync import buckets  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- rollout --------------------------------------------------------------------------------------

async def _raw(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def one(prompt):
            payload = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                       "logprobs": 0, "return_token_ids": True, "seed": 0}
            async with session.post(url + "/v1/completions", json=payload) as resp:
                reply = await resp.json()
            return len(reply["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def _pooled(pool: EnginePool, prompts: list[list[int]], max_tokens: int) -> int:
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    outs = await asyncio.gather(*(pool.generate(p, sampling) for p in prompts))
    return sum(len(g[0].token_ids) for g in outs)


def bench_rollout(urls: list[str], prompts, max_tokens: int, repeats: int) -> dict:
    def pool_of(n):
        return EnginePool(lambda i: VLLMServerClient(urls[i], model="default"), n)

    cases = {
        "raw": lambda: asyncio.run(_raw(urls[0], prompts, max_tokens)),
        "pool x1": lambda: asyncio.run(_pooled(pool_of(1), prompts, max_tokens)),
        "pool x2": lambda: asyncio.run(_pooled(pool_of(2), prompts, max_tokens)),
    }
    results = {}
    for _ in range(repeats):  # interleaved, so load drifts hit every case alike
        for name, fn in cases.items():
            start = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - start
            results.setdefault(name, []).append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    return results


# ---- weight sync ----------------------------------------------------------------------------------

def _receiver(port: int, rank: int, world: int, infos: list[dict]) -> None:
    group, _store = new_gloo_group("127.0.0.1", port, rank=rank, world_size=world, group_name="raw", timeout_s=600)
    for _ in range(10**9):
        for info in infos:
            flat = torch.empty(info["num_bytes"], dtype=torch.uint8)
            gloo_broadcast(group, flat)
        stop = torch.zeros(1, dtype=torch.uint8)
        gloo_broadcast(group, stop)
        if stop.item():
            return


def bench_raw_broadcast(flats: list[torch.Tensor], infos: list[dict], receivers: int, repeats: int) -> list[float]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(port, r + 1, receivers + 1, infos)) for r in range(receivers)]
    for p in procs:
        p.start()
    group, _store = new_gloo_group("127.0.0.1", port, rank=0, world_size=receivers + 1, group_name="raw",
                                   timeout_s=600, is_master=True)
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        for flat in flats:
            gloo_broadcast(group, flat)
        seconds.append(time.perf_counter() - start)
        gloo_broadcast(group, torch.tensor([1 if r == repeats - 1 else 0], dtype=torch.uint8))
    for p in procs:
        p.join(timeout=60)
    return seconds


def bench_sync(urls: list[str], weights: list[tuple[str, torch.Tensor]], bucket_bytes: int, repeats: int,
               backend: str) -> list[float]:
    sender = WeightSender(urls, backend=backend, master_port=_free_port() if backend == "megamarl_gloo" else 0)
    sender.connect()
    try:
        seconds = []
        for r in range(repeats):
            stats = sender.push(iter(weights), version=r + 1, bucket_bytes=bucket_bytes)
            seconds.append(stats.seconds)
        return seconds
    finally:
        sender.close()


def bench_memcpy(weights: list[tuple[str, torch.Tensor]], repeats: int) -> list[float]:
    dst = [torch.empty_like(t) for _, t in weights]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for d, (_, t) in zip(dst, weights):
            d.copy_(t)
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- main -----------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 where native)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "servers.json"))
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="bench-servers-"))

    def spec(i: int, transfer: str) -> ServerSpec:
        return ServerSpec(policy="bench", replica=i, rank=0, backend="vllm", model_path=str(path), dtype=dtype,
                          max_num_seqs=args.prompts, max_model_len=1024, kv_cache_gib=1, num_threads=1, seed=i,
                          weight_transfer=transfer, log_path=logs / f"server{i}.log")

    servers = [ServerProcess(spec(i, "megamarl_gloo")) for i in range(2)]
    start = time.perf_counter()
    print(f"starting 2 vLLM servers ({args.model}, {dtype}, 1 thread each) ...", flush=True)
    with __import__("concurrent.futures").futures.ThreadPoolExecutor(2) as ex:
        urls = list(ex.map(lambda s: s.start(), servers))
    startup_s = time.perf_counter() - start
    try:
        prompts = [chat_prompts(path)[i % 32] for i in range(args.prompts)]
        print("rollout ...", flush=True)
        rollout = bench_rollout(urls, prompts, args.max_tokens, args.repeats)

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        weights = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
        if model.config.tie_word_embeddings:
            weights = [(n, t) for n, t in weights if n != "lm_head.weight"]
        del model
        num_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        bucket_bytes = args.bucket_mb * 2**20
        packed = []
        for bucket in buckets(iter(weights), bucket_bytes):
            info = bucket_info(bucket)
            packed.append((pack_bucket(bucket, info), info))
        flats, infos = [f for f, _ in packed], [i for _, i in packed]
        print(f"weight sync of {num_bytes / 1e6:.0f} MB ...", flush=True)
        sync = {
            "raw broadcast x1": bench_raw_broadcast(flats, infos, 1, args.repeats),
            "gloo push x1": bench_sync(urls[:1], weights, bucket_bytes, args.repeats, "megamarl_gloo"),
            "raw broadcast x2": bench_raw_broadcast(flats, infos, 2, args.repeats),
            "gloo push x2": bench_sync(urls, weights, bucket_bytes, args.repeats, "megamarl_gloo"),
            "memcpy": bench_memcpy(weights, args.repeats),
        }
        servers[1].spec = spec(1, "megamarl_shm")
        servers[1].restart()
        sync["shm push x1"] = bench_sync([servers[1].url], weights, bucket_bytes, args.repeats, "megamarl_shm")
    finally:
        for s in servers:
            s.stop()

    best_tps = {k: max(r["tokens_per_s"] for r in v) for k, v in rollout.items()}
    best_s = {k: min(v) for k, v in sync.items()}
    gbps = {k: num_bytes / s / 1e9 for k, s in best_s.items()}
    ratios = {
        "pool x1 / raw": best_tps["pool x1"] / best_tps["raw"],
        "pool x2 / raw": best_tps["pool x2"] / best_tps["raw"],
        "gloo push x1 / raw broadcast x1": gbps["gloo push x1"] / gbps["raw broadcast x1"],
        "gloo push x2 / raw broadcast x2": gbps["gloo push x2"] / gbps["raw broadcast x2"],
        "shm push x1 / memcpy": gbps["shm push x1"] / gbps["memcpy"],
    }
    print(f"\nrollout: {args.prompts} prompts x {args.max_tokens} tokens, best of {args.repeats}")
    print(f"{'case':<12} {'tokens/s':>10}")
    for k, v in best_tps.items():
        print(f"{k:<12} {v:>10.1f}")
    print(f"\nweight sync: {num_bytes / 1e6:.0f} MB in {dtype}, {len(flats)} buckets of <= {args.bucket_mb} MiB")
    print(f"{'case':<18} {'seconds':>8} {'GB/s':>8}")
    for k in best_s:
        print(f"{k:<18} {best_s[k]:>8.3f} {gbps[k]:>8.3f}")
    print()
    for k, v in ratios.items():
        print(f"{k:<34} {v:.2f}")
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_servers.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "model": args.model, "dtype": dtype, "server_startup_s": startup_s,
        "rollout": {"prompts": args.prompts, "max_tokens": args.max_tokens, "best_tokens_per_s": best_tps,
                    "repeats": rollout},
        "weight_sync": {"bytes": num_bytes, "buckets": len(flats), "best_seconds": best_s, "gbps": gbps,
                        "repeats_s": sync},
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
