"""Rollout through engine servers, side by side in one run on this node (issue #14, item 7).

    python scripts/bench_server_rollout.py [--model smollm2-135m-instruct] [--prompts 64] [--max-tokens 32]
                                           [--repeats 3] [--out docs/bench/server_rollout.json]

Starts two real vLLM servers (``ServerProcess``, one CPU thread each, ``--enforce-eager``) and sends
the same prompts (chat-templated questions, ``--max-tokens`` each, temperature 1, all in flight at
once) (a) straight to server 0 with one aiohttp session (``raw``: one raw vLLM server), (b) through
our ``EnginePool`` of ``VLLMServerClient`` with server 0 only (``pool x1``: our routing overhead is
``pool x1 / raw``) and (c) with both servers (``pool x2``). Tokens/s, best of ``--repeats``
(interleaved: the machine is shared); the table is printed and the JSON holds the machine, its load
and every repeat. Weight sync into servers: ``scripts/bench_server_sync.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_rollout import chat_prompts, machine_info

from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.hardware import resolve_dtype
from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.vllm_server import VLLMServerClient
from megamarl.rollout.replicas.pool import EnginePool
from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec

# ---- rollout --------------------------------------------------------------------------------------


async def _raw(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as session:

        async def one(prompt):
            payload = {
                "model": "default",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "logprobs": 0,
                "return_token_ids": True,
                "seed": 0,
            }
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
            results.setdefault(name, []).append(
                {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
            )
    return results


# ---- main -----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 where native)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "server_rollout.json"))
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="bench-servers-"))

    def spec(i: int) -> ServerSpec:
        return ServerSpec(
            policy="bench",
            replica=i,
            rank=0,
            backend="vllm",
            model_path=str(path),
            dtype=dtype,
            max_num_seqs=args.prompts,
            max_model_len=1024,
            kv_cache_gib=1,
            num_threads=1,
            seed=i,
            log_path=logs / f"server{i}.log",
        )

    servers = [ServerProcess(spec(i)) for i in range(2)]
    start = time.perf_counter()
    print(f"starting 2 vLLM servers ({args.model}, {dtype}, 1 thread each) ...", flush=True)
    with ThreadPoolExecutor(2) as ex:
        urls = list(ex.map(lambda s: s.start(), servers))
    startup_s = time.perf_counter() - start
    try:
        prompts = [chat_prompts(path)[i % 32] for i in range(args.prompts)]
        print("rollout ...", flush=True)
        rollout = bench_rollout(urls, prompts, args.max_tokens, args.repeats)
    finally:
        for s in servers:
            s.stop()

    best_tps = {k: max(r["tokens_per_s"] for r in v) for k, v in rollout.items()}
    ratios = {
        "pool x1 / raw": best_tps["pool x1"] / best_tps["raw"],
        "pool x2 / raw": best_tps["pool x2"] / best_tps["raw"],
    }
    print(f"\nrollout: {args.prompts} prompts x {args.max_tokens} tokens, best of {args.repeats}")
    print(f"{'case':<12} {'tokens/s':>10}")
    for k, v in best_tps.items():
        print(f"{k:<12} {v:>10.1f}")
    print()
    for k, v in ratios.items():
        print(f"{k:<34} {v:.2f}")
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_server_rollout.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "model": args.model,
        "dtype": dtype,
        "server_startup_s": startup_s,
        "rollout": {
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "best_tokens_per_s": best_tps,
            "repeats": rollout,
        },
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
