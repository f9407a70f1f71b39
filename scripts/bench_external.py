"""Rollout throughput of one team three ways: built-in agents, an external program per episode, and
long-lived external programs.

The team is examples/openai_team's (solver and verifier, one shared SmolLM2-135M-Instruct policy, the
math env's add1/add2/word tasks, the example's sampling). (a) ``builtin``: the ``solve_verify``
orchestra with the env's own agents; (b) ``per_episode``: the ``external`` orchestra starting
``team.py`` (official ``openai`` client) once per episode; (c) ``long_lived``: ``team_workers.py`` (the
same ``play``), ``orchestra.kwargs.mode=long_lived``. One engine, one event loop per mode (as the
driver's rollout loop), ``--rounds`` rollouts of ``--tasks`` x ``--group-size`` episodes each; the
first round of (c) includes its workers' start. Prints a table and writes docs/bench/external.json
with the machine and its load.

    python scripts/bench_external.py [--engine vllm] [--tasks 8] [--group-size 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench_rollout import machine_info  # scripts/ (the script's directory) is on sys.path

from megamarl.config import EngineConfig
from megamarl.models.packaged import resolve_model_path
from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.orchestration.orchestras import default_kinds
from megamarl.rollout.replicas.factory import build_engine

EXAMPLE = ROOT / "examples" / "openai_team"
MAX_TOKENS = {"solver": 24, "verifier": 8}  # examples/openai_team/openai_team.yaml


def orchestras(concurrency: int) -> dict[str, tuple[str, dict]]:
    external = {"roles": ["solver", "verifier"], "timeout_s": 120, "max_concurrency": concurrency}
    return {
        "builtin": ("solve_verify", {}),
        "per_episode": ("external", {**external, "command": ["python", str(EXAMPLE / "team.py")]}),
        "long_lived": (
            "external",
            {
                **external,
                "command": ["python", str(EXAMPLE / "team_workers.py")],
                "mode": "long_lived",
                "num_workers": concurrency,
            },
        ),
    }


def bench_mode(mode: str, name: str, kwargs: dict, *, engine, tokenizer, maker, args) -> dict:
    orchestra = build_orchestra(name, **kwargs)
    configs = {
        role: AgentConfig(policy="shared", sampling=SamplingConfig(temperature=0.7, max_tokens=n))
        for role, n in MAX_TOKENS.items()
    }
    agents = build_agents(
        configs, tokenizer, default_kinds=default_kinds(orchestra, maker.agents, maker.default_agents)
    )

    async def rounds() -> list[dict]:
        out = []
        for r in range(args.rounds):
            start = time.perf_counter()
            result = await run_episodes(
                orchestra,
                maker,
                maker.tasks(args.tasks, seed=r),
                agents=agents,
                engines={"shared": engine},
                group_size=args.group_size,
                max_concurrency=args.concurrency,
                seed=r,
            )
            seconds = time.perf_counter() - start
            tokens = sum(len(s.response_ids) for s in result.samples)
            ok = [e for e in result.episodes if e.status == "ok"]
            out.append(
                {
                    "round": r,
                    "episodes": len(result.episodes),
                    "failed": result.num_failed,
                    "seconds": seconds,
                    "episodes_per_s": len(result.episodes) / seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "calls": len(result.samples),
                    "team_reward_mean": sum(e.team_reward for e in ok) / max(len(ok), 1),
                    "load_avg_1m": os.getloadavg()[0],
                }
            )
            print(f"{mode:12s} round {r}: {out[-1]}", flush=True)
        return out

    timings = asyncio.run(rounds())
    return {"mode": mode, "rounds": timings, **orchestra.counters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="episodes (programs) at once")
    parser.add_argument("--modes", nargs="+", default=["builtin", "per_episode", "long_lived"])
    parser.add_argument("--out", default="docs/bench/external.json")
    args = parser.parse_args()
    os.chdir(ROOT)

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = build_engine(EngineConfig(backend=args.engine, kv_cache_gib=0.5), path, seed=0)
    maker = EnvMaker("math", kinds=["add1", "add2", "word"])
    load_before = os.getloadavg()
    results = [
        bench_mode(mode, name, kwargs, engine=engine, tokenizer=tokenizer, maker=maker, args=args)
        for mode, (name, kwargs) in orchestras(args.concurrency).items()
        if mode in args.modes
    ]
    engine.shutdown()

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rollout of examples/openai_team's team, {args.model} ({args.engine}), "
        f"{args.tasks} x {args.group_size} episodes a round, {args.concurrency} at once"
    )
    for col in ("mode", "round", "episodes", "failed", "seconds", "episodes/s", "tokens/s", "program starts"):
        table.add_column(col, justify="right")
    for mode in results:
        for r in mode["rounds"]:
            table.add_row(
                mode["mode"],
                str(r["round"]),
                str(r["episodes"]),
                str(r["failed"]),
                f"{r['seconds']:.1f}",
                f"{r['episodes_per_s']:.2f}",
                f"{r['tokens_per_s']:.1f}",
                f"{mode.get('program_starts', 0):.0f}" if r["round"] == len(mode["rounds"]) - 1 else "",
            )
    Console(width=120).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_external.py " + " ".join(sys.argv[1:]),
        "machine": {**machine_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "model": args.model,
        "engine": args.engine,
        "tasks": args.tasks,
        "group_size": args.group_size,
        "concurrency": args.concurrency,
        "notes": "builtin: solve_verify with the math env's agents; per_episode: team.py per episode; "
        "long_lived: team_workers.py, one program per concurrent episode, started at round 0; "
        "program_starts: the orchestra's total over all rounds",
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
