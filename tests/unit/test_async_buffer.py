"""The staleness machinery of megamarl.driver.streaming: group staleness, the bounded group buffer
(bound never exceeded, drops counted, per-policy readiness), the histogram and the busy clock."""

import random
import threading
import time

import pytest

from megamarl.driver.streaming import (
    BusyClock,
    EpisodeGroup,
    GroupBuffer,
    StalenessStats,
    group_samples,
    split_fresh,
)
from megamarl.errors import ProgramCrashLoopError
from megamarl.orchestration.episodes import EpisodeStats
from megamarl.rl.sample import Sample


def sample(task: str, version: int, *, policy: str = "a", agent: str = "x") -> Sample:
    return Sample(
        task_id=task, episode_id=f"{task}/0", agent=agent, policy=policy, turn=0, weight_version=version
    )


def group(task: str, versions, *, policy: str = "a") -> EpisodeGroup:
    return EpisodeGroup(task, [sample(task, v, policy=policy) for v in versions])


def test_group_staleness_is_its_stalest_sample_and_ignores_untracked_policies():
    g = EpisodeGroup("t", [sample("t", 5), sample("t", 3), sample("t", 0, policy="frozen")])
    assert g.staleness({"a": 6}) == 3
    assert g.staleness({"a": 3}) == 0
    fresh, stale = split_fresh([g, group("u", [6])], {"a": 6}, max_staleness=2)
    assert [x.task_id for x in fresh] == ["u"] and [x.task_id for x in stale] == ["t"]


def test_group_samples_keeps_task_order_and_sample_order():
    samples = [sample("t1", 0), sample("t2", 0), sample("t1", 1)]
    groups = group_samples(samples)
    assert [g.task_id for g in groups] == ["t1", "t2"]
    assert [s.weight_version for s in groups[0].samples] == [0, 1]


def test_staleness_stats_histogram_and_metrics():
    stats = StalenessStats()
    stats.record_trained([group("t", [3, 2, 2])], {"a": 3})
    stats.record_dropped([group("u", [0, 0])])
    m = stats.metrics()
    assert m["async/staleness/0"] == 1 and m["async/staleness/1"] == 2
    assert m["async/staleness_max"] == 1 and m["async/staleness_mean"] == pytest.approx(2 / 3)
    assert m["async/dropped_stale_groups"] == 1 and m["async/dropped_stale_samples"] == 2


def test_staleness_histogram_per_agent():
    # issue #46 item 4: each agent's own lag histogram beside the whole batch's
    stats = StalenessStats()
    samples = [sample("t", 3, agent="solver"), sample("t", 2, agent="solver"), sample("t", 1, agent="critic")]
    stats.record_trained([EpisodeGroup("t", samples)], {"a": 3})
    m = stats.metrics()
    assert {k: v for k, v in m.items() if k.startswith("async/agent/")} == {
        "async/agent/critic/staleness/2": 1.0,
        "async/agent/critic/staleness_mean": 2.0,
        "async/agent/solver/staleness/0": 1.0,
        "async/agent/solver/staleness/1": 1.0,
        "async/agent/solver/staleness_mean": 0.5,
    }
    assert m["async/staleness/0"] == 1 and m["async/staleness/1"] == 1 and m["async/staleness/2"] == 1


def test_buffer_capacity_counts_in_flight_and_waiting_groups():
    buf = GroupBuffer(groups_per_batch=2, capacity=3, per_policy=False)
    for _ in range(3):
        assert buf.has_space()
        buf.start_group()
    assert not buf.has_space()
    buf.put(group("t0", [0]), [])
    assert not buf.has_space()  # finished but not taken: still counts
    buf.put(group("t1", [0]), [])
    buf.take({"a": 0}, max_staleness=1)
    assert buf.has_space() and buf.in_flight == 1


def test_buffer_take_drops_and_counts_stale_groups_and_returns_fresh_ones_oldest_first():
    buf = GroupBuffer(groups_per_batch=2, capacity=10, per_policy=False)
    for task, v in [("old", 0), ("new1", 2), ("new2", 3), ("new3", 3)]:
        buf.start_group()
        buf.put(group(task, [v, v]), [EpisodeStats(task, f"{task}/0", "ok")])
    parts, episodes, dropped = buf.take({"a": 3}, max_staleness=1)
    assert [p.task_id for p in parts] == ["new1", "new2"]
    assert dropped.dropped_groups == 1 and dropped.dropped_samples == 2
    assert len(episodes) == 4 and buf.depth() == 1


def test_buffer_per_policy_lets_a_common_policy_train_while_a_rare_one_fills():
    buf = GroupBuffer(groups_per_batch=2, capacity=2, per_policy=True)
    for i in range(2):
        buf.start_group()
        samples = [sample(f"t{i}", 0, policy="common")] + (
            [sample(f"t{i}", 0, policy="rare")] if i == 0 else []
        )
        buf.put(EpisodeGroup(f"t{i}", samples), [])
    parts, _, _ = buf.take({"common": 0, "rare": 0}, max_staleness=1)
    assert {s.policy for p in parts for s in p.samples} == {"common"}
    assert buf.has_space()  # the rare policy's single waiting part does not block admission
    buf.start_group()
    buf.put(EpisodeGroup("t2", [sample("t2", 0, policy="rare")]), [])
    parts, _, _ = buf.take({"common": 0, "rare": 0}, max_staleness=1)
    assert [p.task_id for p in parts] == ["t0", "t2"] and {s.policy for p in parts for s in p.samples} == {
        "rare"
    }


def test_buffer_never_hands_out_a_sample_beyond_the_bound_under_random_traffic():
    """Random producer versions and trainer versions: every handed-out sample is within the bound,
    and every group put is either handed out, dropped (counted) or still waiting."""
    rng = random.Random(0)
    for max_staleness in (1, 2, 3):
        buf = GroupBuffer(groups_per_batch=3, capacity=12, per_policy=rng.random() < 0.5)
        versions = {"a": 0, "b": 0}
        num_put = num_out = num_dropped = 0
        for i in range(400):
            if buf.has_space():
                buf.start_group()
                samples = [
                    sample(f"t{i}", max(0, versions[p] - rng.randrange(4)), policy=p) for p in ("a", "b")
                ]
                buf.put(EpisodeGroup(f"t{i}", samples), [])
                num_put += 2
            if rng.random() < 0.3:
                versions[rng.choice("ab")] += 1
            if rng.random() < 0.5:
                try:
                    parts, _, dropped = buf.take(versions, max_staleness, timeout=0)
                except TimeoutError:
                    continue
                num_dropped += dropped.dropped_samples
                for part in parts:
                    assert part.staleness(versions) <= max_staleness
                    num_out += part.num_samples
        waiting = sum(p.num_samples for q in buf._queues.values() for p in q)
        num_dropped += buf._dropped.dropped_samples  # dropped by takes that timed out
        assert num_put == num_out + num_dropped + waiting and num_dropped > 0


def test_buffer_take_blocks_until_a_batch_is_ready_and_reports_producer_errors():
    buf = GroupBuffer(groups_per_batch=1, capacity=2, per_policy=False)
    buf.start_group()
    threading.Timer(0.05, lambda: buf.put(group("t", [0]), [])).start()
    parts, _, _ = buf.take({"a": 0}, 1, poll_s=0.01)
    assert [p.task_id for p in parts] == ["t"]
    threading.Timer(0.05, lambda: buf.fail(ValueError("bad config"))).start()
    with pytest.raises(RuntimeError, match="bad config"):
        buf.take({"a": 0}, 1, poll_s=0.01)
    # an error that stops the run (a crash-looping external program) keeps its type: its exit code
    buf = GroupBuffer(groups_per_batch=1, capacity=2, per_policy=False)
    buf.fail(ProgramCrashLoopError("the program exited before finishing an episode 3 times"))
    with pytest.raises(ProgramCrashLoopError, match="3 times"):
        buf.take({"a": 0}, 1, poll_s=0.01)


def test_buffer_rejects_a_capacity_below_one_batch():
    with pytest.raises(ValueError, match="capacity"):
        GroupBuffer(groups_per_batch=4, capacity=3, per_policy=False)


def test_busy_clock_counts_only_in_flight_unsuspended_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("megamarl.driver.streaming.time.perf_counter", lambda: now[0])
    clock = BusyClock()
    now[0] = 1.0
    clock.enter(2)  # busy from 1
    now[0] = 2.0
    clock.suspend()  # weight update: not busy from 2
    now[0] = 3.0
    clock.resume()
    clock.exit(1)
    now[0] = 4.0
    clock.exit(1)  # idle from 4
    now[0] = 10.0
    assert clock.busy_seconds() == pytest.approx(2.0)
    assert clock.active == 0


def test_busy_clock_is_thread_safe():
    clock = BusyClock()

    def work():
        for _ in range(1000):
            clock.enter()
            clock.exit()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.active == 0 and clock.busy_seconds() < time.perf_counter()
