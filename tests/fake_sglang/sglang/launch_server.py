"""``python -m sglang.launch_server`` of the fake ``sglang`` package: parses the SGLang server flags
that ``megamarl.rollout.servers.server_launch.server_command`` emits (an unknown flag is an error, so the
command line stays within SGLang's real CLI) and serves ``FakeSGLangServer`` on ``--host:--port``.
Every call is printed as one ``[fake-sglang] {json}`` line to stdout (the server's log file)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

DTYPES = {
    "auto": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (fake)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=None)
    # GPU memory (accepted and ignored: the fake runs transformers on CPU)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    # CPU (SGLANG_USE_CPU_ENGINE=1) and model overrides: accepted and ignored (the fake is transformers
    # on CPU and loads any HF directory)
    p.add_argument("--device", default=None, choices=["cuda", "cpu", "xpu", "hpu", "npu"])
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--sampling-backend", default=None, choices=["flashinfer", "pytorch"])
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--json-model-override-args", default="{}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from megamarl.rollout.engines.hf import HFEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the fake server lives there
    from fake_servers import FakeSGLangServer

    engine = HFEngine(
        args.model_path,
        dtype=getattr(torch, DTYPES[args.dtype]),
        seed=args.random_seed,
        max_batch_rows=args.max_running_requests,
        max_wait_ms=2.0,
    )

    lock = threading.Lock()  # handler threads log concurrently: one whole line per record

    def log(record: dict) -> None:
        with lock:
            sys.stdout.write("[fake-sglang] " + json.dumps(record) + "\n")
            sys.stdout.flush()

    server = FakeSGLangServer(
        engine, host=args.host, port=args.port, model_path=args.model_path, tp_size=args.tp_size, log=log
    )
    print(
        f"[fake-sglang] serving {args.model_path} at {server.url} (tp_size {args.tp_size}, dtype "
        f"{args.dtype})",
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
