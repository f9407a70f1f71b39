"""Episode transcripts: what the agents said, for a person debugging an env, a prompt or a parser.

Each training step the driver keeps ``logger.episodes_per_step`` finished episodes as
``<run_dir>/episodes/step_<N>.jsonl`` (N as in metrics.jsonl), one JSON object per episode with its
status, rewards, per-agent success and ``calls``: per agent call its ``prompt`` exactly as the engine
received it, ``response`` (the decoded reply), ``action`` (the parsed value, null when it did not
parse), validity, rewards and ``weight_version``. With wandb on, the calls also go to an ``episodes``
table. Episodes are picked round-robin over tasks. ``scripts/show_episodes.py RUN`` prints the files.
The record's example: docs/design-notes.md, "megamarl/runtime/transcripts.py".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megamarl.rl.batch import SampleBatch

EPISODES_DIR = "episodes"
TABLE_COLUMNS = (
    "step",
    "episode_id",
    "call_step",
    "agent",
    "policy",
    "turn",
    "branch",
    "prompt",
    "response",
    "action",
    "valid",
    "local_reward",
    "team_reward",
)


def pick_episodes(episode_ids: Sequence[str], task_ids: Sequence[str], limit: int) -> list[str]:
    """Up to ``limit`` distinct episode ids, round-robin over tasks in first-appearance order."""
    by_task: dict[str, list[str]] = {}
    for episode, task in zip(
        episode_ids, task_ids, strict=False
    ):  # strict=False: both one per sample by the caller's contract
        episodes = by_task.setdefault(task, [])
        if episode not in episodes:
            episodes.append(episode)
    picked: list[str] = []
    depth = 0
    while len(picked) < limit and any(depth < len(eps) for eps in by_task.values()):
        picked.extend(eps[depth] for eps in by_task.values() if depth < len(eps))
        depth += 1
    return picked[:limit]


def episode_transcripts(
    samples: Sequence,
    episodes: Iterable,
    *,
    step: int,
    limit: int,
    decode: Callable[[str, list[int]], str],
    parse: Callable[[str, str], Any],
) -> list[dict]:
    """Transcripts of up to ``limit`` episodes of ``samples`` (``rl.sample.Sample``, in rollout order).

    ``episodes``: the ``EpisodeStats`` to take status and success from (matched by episode id; an
    episode without one, e.g. reported in an earlier step by an async schedule, gets nulls);
    ``decode(policy, ids)``: the policy's tokenizer; ``parse(agent, text)``: the agent's parsed action
    (None when it does not parse)."""
    if limit <= 0 or not samples:
        return []
    chosen = pick_episodes([s.episode_id for s in samples], [s.task_id for s in samples], limit)
    stats = {e.episode_id: e for e in episodes}
    calls: dict[str, list] = {episode: [] for episode in chosen}
    for s in samples:
        if s.episode_id in calls:
            calls[s.episode_id].append(s)
    records = []
    for episode in chosen:
        rows = sorted(calls[episode], key=lambda s: (s.step, s.branch))
        info = stats.get(episode)
        records.append(
            {
                "step": step,
                "task_id": rows[0].task_id,
                "episode_id": episode,
                "status": info.status if info else None,
                "success": info.success if info else None,
                "team_reward": rows[0].team_reward,
                "agent_success": dict(info.agent_success) if info else None,
                "calls": [_call(s, decode, parse) for s in rows],
            }
        )
    return records


def _call(s, decode, parse) -> dict:
    action = parse(s.agent, s.response_text)
    return {
        "step": s.step,
        "agent": s.agent,
        "policy": s.policy,
        "turn": s.turn,
        "branch": s.branch,
        "prompt": decode(s.policy, s.prompt_ids),
        "response": s.response_text,
        "action": None if action is None else str(action),
        "valid": s.valid,
        "truncated": s.truncated,
        "local_reward": s.local_reward,
        "team_reward": s.team_reward,
        "weight_version": s.weight_version,
    }


def write_transcripts(run_dir: Path, step: int, records: Sequence[Mapping[str, Any]]) -> Path:
    """``<run_dir>/episodes/step_<step>.jsonl`` (rewritten whole: a resumed run redoes a step)."""
    path = Path(run_dir) / EPISODES_DIR / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)
    return path


def trained_groups(batch: SampleBatch, keys: Mapping[str, Sequence[str]]) -> dict[str, dict]:
    """A step's ``trained_groups.jsonl`` record: for each policy of ``batch`` its estimator's group key
    ``keys[policy]`` and every group as ``[*key values, num_samples]``, in first-appearance order."""
    out: dict[str, dict] = {}
    for policy in dict.fromkeys(batch.names("policy")):
        key = tuple(keys[policy])
        sizes = batch.group_sizes(("policy", *key))
        out[policy] = {"key": list(key), "groups": [[*g[1:], n] for g, n in sizes.items() if g[0] == policy]}
    return out


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list]:
    """One row per call (``TABLE_COLUMNS``) for a wandb table."""
    return [
        [
            r["step"],
            r["episode_id"],
            c["step"],
            c["agent"],
            c["policy"],
            c["turn"],
            c["branch"],
            c["prompt"],
            c["response"],
            c["action"],
            c["valid"],
            c["local_reward"],
            c["team_reward"],
        ]
        for r in records
        for c in r["calls"]
    ]


def read_transcripts(run_dir: Path, step: int | None = None) -> tuple[int, list[dict]]:
    """``(step, records)`` of ``step`` (None: the latest step written). Raises FileNotFoundError
    naming what exists when there is no such file."""
    folder = Path(run_dir) / EPISODES_DIR
    files = folder.glob("step_*.jsonl") if folder.is_dir() else []
    steps = sorted(int(p.stem.split("_", 1)[1]) for p in files)
    if not steps:
        raise FileNotFoundError(
            f"{folder}: no episode transcripts (step_<N>.jsonl); is {run_dir} a run "
            f"directory, and logger.episodes_per_step > 0?"
        )
    if step is None:
        step = steps[-1]
    path = folder / f"step_{step}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such step; steps with transcripts: {_ranges(steps)}")
    return step, [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)} files)" if len(steps) > 3 else ", ".join(map(str, steps))
