"""Print the episode transcripts a run wrote (``<run>/episodes/step_<N>.jsonl``): every agent call's
rendered prompt, reply, parsed action and rewards, episode by episode.

    python scripts/show_episodes.py runs/signalling_tiny                  # the latest step
    python scripts/show_episodes.py runs/signalling_tiny --step 3 --agent receiver

How many episodes each step keeps: ``logger.episodes_per_step`` (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from megamarl.runtime.transcripts import read_transcripts


def render(records: list[dict], *, agent: str | None = None, prompt_chars: int = 0) -> str:
    """The transcripts as text; ``agent``: only that agent's calls; ``prompt_chars`` > 0: only the
    last that many characters of each prompt (the newest turn; the system prompt repeats)."""
    out = []
    for r in records:
        status = r["status"] or "?"
        success = {True: "success", False: "failure", None: "?"}[r["success"]]
        out.append(
            f"=== episode {r['episode_id']} (task {r['task_id']}): {status}, {success}, "
            f"team reward {r['team_reward']:g}"
        )
        if r.get("agent_success"):
            own = (f"{a}={'yes' if ok else 'no'}" for a, ok in r["agent_success"].items())
            out.append("    own success: " + ", ".join(own))
        calls = [c for c in r["calls"] if agent is None or c["agent"] == agent]
        for c in calls:
            flags = "" if c["valid"] else ", INVALID"
            flags += ", truncated" if c["truncated"] else ""
            out.append(
                f"--- step {c['step']}: {c['agent']} (policy {c['policy']}, turn {c['turn']}, branch "
                f"{c['branch']}, weights v{c['weight_version']}) local reward {c['local_reward']:g}{flags}"
            )
            prompt = c["prompt"]
            if prompt_chars and len(prompt) > prompt_chars:
                prompt = "..." + prompt[-prompt_chars:]
            out.append("  prompt:")
            out.append(textwrap.indent(prompt.rstrip("\n"), "    | "))
            out.append("  reply:")
            out.append(textwrap.indent(c["response"].rstrip("\n") or "(empty)", "    > "))
            out.append(f"  action: {c['action'] if c['action'] is not None else '(did not parse)'}")
        if not calls:
            out.append(f"    (no call by agent {agent!r})")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory (<output_dir>/<name>)")
    parser.add_argument("--step", type=int, default=None, help="the training step (default: the latest)")
    parser.add_argument("--agent", default=None, help="only this agent's calls")
    parser.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="print only the last N characters of each prompt (default: all of it)",
    )
    args = parser.parse_args(argv)
    try:
        step, records = read_transcripts(args.run, args.step)
    except FileNotFoundError as exc:
        print(f"show_episodes: {exc}", file=sys.stderr)
        return 2
    if args.agent is not None:
        known = {c["agent"] for r in records for c in r["calls"]}
        if args.agent not in known:
            print(
                f"show_episodes: no agent {args.agent!r} at step {step}; agents: {sorted(known)}",
                file=sys.stderr,
            )
            return 2
    try:
        print(f"{args.run} step {step}: {len(records)} episodes\n")
        print(render(records, agent=args.agent, prompt_chars=args.prompt_chars), flush=True)
    except BrokenPipeError:  # piped into head / less, which closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
