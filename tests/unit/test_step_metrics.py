"""Per-step statistics (megamarl.runtime.step_metrics) on hand-built batches and episodes, exact numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megamarl.orchestration.episodes import EpisodeStats
from megamarl.rl.batch import collate
from megamarl.rl.batch_metrics import agent_batch_metrics, success_metrics
from megamarl.rl.sample import Sample
from megamarl.runtime.step_metrics import (
    ResidentMemory,
    idle_seconds,
    merge_rank_metrics,
    throughput_metrics,
)


def _sample(agent, policy, reward, *, prompt=2, response=1, valid=True, truncated=False):
    return Sample(
        "t",
        "t/0",
        agent,
        policy,
        0,
        prompt_ids=[5] * prompt,
        response_ids=[7] * response,
        rollout_logprobs=[-0.5] * response,
        team_reward=reward,
        valid=valid,
        truncated=truncated,
    )


@pytest.fixture
def batch():
    samples = [
        _sample("x", "alpha", 1.0, response=3, truncated=True),
        _sample("x", "beta", -1.0, response=1),
        _sample("x", "alpha", 0.0, response=2, valid=False),
        _sample("o", "beta", 0.5, prompt=4, response=4, truncated=True),
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -1.0, 0.0, 2.0]))


def test_agent_batch_metrics(batch):
    m = agent_batch_metrics(batch)
    # agent x: rewards [1, -1, 0] -> mean 0, population std sqrt(2/3), min -1, max 1
    assert m["agent/x/reward_mean"] == 0.0
    assert m["agent/x/reward_std"] == pytest.approx((2 / 3) ** 0.5)
    assert (m["agent/x/reward_min"], m["agent/x/reward_max"]) == (-1.0, 1.0)
    assert m["agent/x/advantage_mean"] == 0.0 and m["agent/x/advantage_std"] == pytest.approx((2 / 3) ** 0.5)
    assert m["agent/x/response_len"] == 2.0  # (3 + 1 + 2) / 3
    assert m["agent/x/response_clip_ratio"] == pytest.approx(1 / 3)
    assert m["agent/x/invalid_rate"] == pytest.approx(1 / 3)
    assert m["agent/x/num_samples"] == 3.0
    assert (m["agent/o/reward_std"], m["agent/o/advantage_mean"], m["agent/o/response_clip_ratio"]) == (
        0.0,
        2.0,
        1.0,
    )


def test_token_level_advantages_average_over_response_tokens(batch):
    per_token = torch.zeros(batch.tokens.shape)
    per_token[3, :] = 9.0  # padding/prompt positions must not count
    per_token[3][batch.response_mask[3]] = 3.0
    m = agent_batch_metrics(batch.replace(advantages=per_token))
    assert (m["agent/o/advantage_mean"], m["agent/o/advantage_std"]) == (3.0, 0.0)


def test_critic_estimators_have_no_driver_advantages(batch):
    assert not any("advantage" in k for k in agent_batch_metrics(batch.replace(advantages=None)))


def test_own_success_per_agent_and_policy():
    def episode(winner, policies):
        return EpisodeStats(
            "t", "e", "ok", agent_success={"x": winner == "x", "o": winner == "o"}, policies=policies
        )

    episodes = [
        episode("x", {"x": "alpha", "o": "beta"}),
        episode("x", {"x": "beta", "o": "alpha"}),
        episode("o", {"x": "alpha", "o": "beta"}),
        episode(None, {"x": "beta", "o": "alpha"}),
    ]
    assert success_metrics(episodes) == {
        "agent/o/success": 0.25,
        "agent/x/success": 0.5,  # not a copy of one team success
        "policy/alpha/success": 0.25,
        "policy/beta/success": 0.5,  # alpha won 1 of its 4 seats, beta 2
    }


def test_throughput_idle_and_rank_merge(batch):
    assert throughput_metrics(num_train_tokens=900, update_s=3.0, num_samples=8, step_s=4.0) == {
        "perf/train_tokens_per_s": 300.0,
        "perf/samples_per_s": 2.0,
    }
    step = {
        "timing_s/step": 10.0,
        "timing_s/rollout": 3.0,
        "timing_s/update": 4.5,
        "timing_s/alpha/update": 4.0,
    }
    assert idle_seconds(step) == 2.5  # nested per-policy sections are inside update, not counted twice
    merged = merge_rank_metrics(
        [
            {"perf/max_memory_gib/alpha": 2.0, "policy/alpha/lr": 1.0},
            {"perf/max_memory_gib/alpha": 3.5, "policy/alpha/lr": 1.0},
            {"perf/max_memory_gib/alpha": 1.0},
        ]
    )
    assert merged == {"perf/max_memory_gib/alpha": 3.5, "policy/alpha/lr": 1.0}


def test_env_metrics_are_means_over_the_finished_episodes():
    """``env/<key>``: ``Env.metrics()`` averaged over the step's finished episodes (a failed one has
    none), so the figure does not grow with rollout.num_tasks x group_size."""
    from megamarl.orchestration.episodes import RolloutResult

    episodes = [
        EpisodeStats("t", "e0", "ok", env_metrics={"judge_errors": 1.0, "cases": 4.0}),
        EpisodeStats("t", "e1", "ok", env_metrics={"judge_errors": 0.0, "cases": 2.0}),
        EpisodeStats("t", "e2", "failed"),
        EpisodeStats("t", "e3", "ok", env_metrics={"judge_errors": 2.0, "cases": 3.0}),
    ]
    summary = RolloutResult([], episodes).summary()
    assert summary["env/judge_errors"] == 1.0 and summary["env/cases"] == 3.0


def _status(proc, rss_kib: int, hwm_kib: int) -> None:
    (proc / "status").write_text(
        f"Name:\tpython\nVmHWM:\t {hwm_kib} kB\nVmRSS:\t {rss_kib} kB\nThreads:\t3\n"
    )


def test_resident_memory_reports_each_windows_peak_and_keeps_the_runs(tmp_path):
    """Exact numbers from a /proc/<pid> of the test's own: the RSS now and the window's peak per rank,
    the peak reset after each read (clear_refs gets "5"), the run's peak for perf/max_memory_gib."""
    memory = ResidentMemory(tmp_path)
    _status(tmp_path, rss_kib=2**20, hwm_kib=3 * 2**20)  # 1 GiB now, 3 GiB peak
    first = memory.step_metrics(1, policies=["p", "q"])
    assert (tmp_path / "clear_refs").read_text() == "5"
    _status(tmp_path, rss_kib=2**20, hwm_kib=3 * 2**19)  # the next window peaked at 1.5 GiB
    second = memory.step_metrics(1, policies=["p"])
    assert first == {
        "memory/rss_gib/rank1": 1.0,
        "memory/peak_rss_gib/rank1": 3.0,
        "perf/max_memory_gib/p": 3.0,
        "perf/max_memory_gib/q": 3.0,
    }
    assert second == {
        "memory/rss_gib/rank1": 1.0,
        "memory/peak_rss_gib/rank1": 1.5,
        "perf/max_memory_gib/p": 3.0,  # the run's peak, not the window's
    }


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc")
def test_resident_memory_windows_of_this_process():
    """The real process: a 256 MiB tensor allocated and freed inside a window shows in that window's
    peak and not in the next one's."""
    memory = ResidentMemory()
    memory.step_metrics(0, policies=[])
    torch.ones(64 * 2**20).sum()  # 256 MiB, freed at once
    first = memory.step_metrics(0, policies=["p"])
    second = memory.step_metrics(0, policies=["p"])
    now = "memory/rss_gib/rank0"
    assert first["memory/peak_rss_gib/rank0"] - first[now] > 0.24
    assert second["memory/peak_rss_gib/rank0"] - second[now] < 0.05
    assert second["perf/max_memory_gib/p"] >= first[now] + 0.24
