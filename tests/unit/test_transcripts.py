"""Episode transcripts (megamarl.runtime.transcripts) and scripts/show_episodes.py: which episodes are
kept, what a record holds, the file round trip and the printed text. A real run's files are checked
by tests/integration/test_trainer_features.py."""

import json
from pathlib import Path

import pytest
from script_loader import load_script  # tests/ helper

from megamarl.orchestration.episodes import EpisodeStats
from megamarl.rl.sample import Sample
from megamarl.runtime.metrics import LoggerConfig
from megamarl.runtime.transcripts import (
    episode_transcripts,
    pick_episodes,
    read_transcripts,
    write_transcripts,
)

ROOT = Path(__file__).resolve().parents[2]
show_episodes = load_script("scripts/show_episodes.py")


def test_pick_episodes_round_robin_over_tasks():
    episodes = ["a/0", "a/0", "a/1", "a/2", "b/0", "b/1", "c/0"]
    tasks = ["a", "a", "a", "a", "b", "b", "c"]
    assert pick_episodes(episodes, tasks, 4) == ["a/0", "b/0", "c/0", "a/1"]
    assert pick_episodes(episodes, tasks, 10) == ["a/0", "b/0", "c/0", "a/1", "b/1", "a/2"]
    assert pick_episodes(episodes, tasks, 0) == []


def _samples():
    def s(task, g, step, agent, text, local, valid=True):
        return Sample(
            task_id=task,
            episode_id=f"{task}/{g}",
            agent=agent,
            policy="p",
            turn=0,
            step=step,
            prompt_ids=[step, 7],
            response_ids=[1],
            response_text=text,
            team_reward=1.0 if g == 0 else 0.0,
            local_reward=local,
            valid=valid,
            weight_version=3,
        )

    # rollout order is not step order within an episode (concurrent agents): records sort by step
    return [
        s("t", 0, 1, "receiver", "5", 0.5),
        s("t", 0, 0, "sender", "E", 0.0),
        s("t", 1, 0, "sender", "??", 0.0, valid=False),
        s("u", 0, 0, "sender", "C", 0.0),
    ]


def test_episode_transcripts_records():
    stats = [EpisodeStats("t", "t/0", "ok", team_reward=1.0, success=True, agent_success={"sender": True})]
    records = episode_transcripts(
        _samples(),
        stats,
        step=4,
        limit=2,
        decode=lambda policy, ids: f"<{policy}>{ids}",
        parse=lambda agent, text: None if text == "??" else text.lower(),
    )
    assert [r["episode_id"] for r in records] == ["t/0", "u/0"]  # one per task first
    first = records[0]
    assert (first["step"], first["status"], first["success"], first["team_reward"]) == (4, "ok", True, 1.0)
    assert [
        (c["step"], c["agent"], c["prompt"], c["response"], c["action"], c["local_reward"])
        for c in first["calls"]
    ] == [(0, "sender", "<p>[0, 7]", "E", "e", 0.0), (1, "receiver", "<p>[1, 7]", "5", "5", 0.5)]
    assert records[1]["status"] is None and records[1]["success"] is None  # no EpisodeStats for u/0
    assert episode_transcripts(_samples(), [], step=1, limit=0, decode=str, parse=str) == []


def test_files_round_trip_and_show_episodes(tmp_path, capsys):
    records = episode_transcripts(
        _samples(),
        [],
        step=1,
        limit=3,
        decode=lambda p, ids: "system\nsay a digit",
        parse=lambda agent, text: None if text == "??" else text,
    )
    write_transcripts(tmp_path, 1, records)
    write_transcripts(tmp_path, 12, records[:1])
    assert read_transcripts(tmp_path)[0] == 12  # the latest, by number (not "12" < "2" as text)
    step, back = read_transcripts(tmp_path, 1)
    assert step == 1 and back == json.loads(json.dumps(records))
    with pytest.raises(FileNotFoundError, match="steps with transcripts: 1, 12"):
        read_transcripts(tmp_path, 5)
    assert show_episodes.main([str(tmp_path), "--step", "1", "--agent", "sender"]) == 0
    text = capsys.readouterr().out
    assert "=== episode t/1 (task t): ?, ?, team reward 0" in text
    assert "    | say a digit" in text and "    > ??" in text and "action: (did not parse)" in text
    assert ", INVALID" in text and "receiver" not in text
    assert show_episodes.main([str(tmp_path), "--agent", "critic"]) == 2
    assert "no agent 'critic'" in capsys.readouterr().err
    assert show_episodes.main([str(tmp_path / "nope")]) == 2


def test_episodes_per_step_is_validated():
    assert LoggerConfig().episodes_per_step == 2
    with pytest.raises(ValueError, match="logger.episodes_per_step"):
        LoggerConfig(episodes_per_step=-1)
