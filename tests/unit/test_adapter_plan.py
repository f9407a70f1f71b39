"""L2 adapter by adapter (megamarl.rl.adapters): which adapters step in an update and which rows are
dropped (``policies.<p>.lora.min_samples``), as the driver plans it, and which adapters the next push
carries (``WeightVersions.to_push``). Hand-counted rows."""

from __future__ import annotations

import pytest

from megamarl.config_sections import LoraConfig
from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.rl.adapters import AdapterPlan, adapter_plan
from megamarl.rl.batch import collate
from megamarl.rl.dispatch import BatchSplit, plan_policy, rank_batches
from megamarl.rl.sample import Sample
from megamarl.rollout.weight_versions import WeightVersions

# agent -> adapter: two agents share "team"; "critic" is frozen
ADAPTERS = {"solver": "s", "verifier": "v", "planner": "team", "worker": "team", "critic": "c"}
AGENTS = ["solver", "solver", "solver", "verifier", "verifier", "planner", "worker", "critic"]


def test_an_adapter_below_the_minimum_does_not_step_and_its_rows_are_counted():
    plan = adapter_plan(AGENTS[:7], ADAPTERS, min_samples=3, frozen_agents={"critic"})
    # s: 3 rows (steps), v: 2 (dropped), team: planner + worker = 2 (dropped), c: frozen (never steps)
    assert plan == AdapterPlan(("s",), {"team": 2, "v": 2}, {"s": 3, "team": 2, "v": 2})


def test_min_samples_zero_is_the_plain_l2_rule_every_trained_adapter_steps():
    # every adapter whose agents are not all frozen steps, on rows or none (v has no row here)
    plan = adapter_plan(["solver", "worker"], ADAPTERS, min_samples=0, frozen_agents={"critic"})
    assert plan == AdapterPlan(("s", "team", "v"), {}, {"s": 1, "team": 1, "v": 0})
    # one of two agents of an adapter frozen: the adapter still trains on the other's rows
    plan = adapter_plan(["worker"], ADAPTERS, min_samples=1, frozen_agents={"planner", "critic"})
    assert plan.stepping == ("team",) and plan.rows == {"s": 0, "team": 1, "v": 0}


def _policy_batch():
    # response lengths 1..8: row i has i + 1 response tokens
    samples = [
        Sample(
            "t",
            f"e{i}",
            agent,
            "base",
            0,
            prompt_ids=[5],
            response_ids=[7] * (i + 1),
            rollout_logprobs=[-0.5] * (i + 1),
        )
        for i, agent in enumerate(AGENTS)
    ]
    return collate(samples, pad_id=0)


def test_the_plan_drops_the_rows_of_adapters_below_the_minimum_before_counting():
    split = BatchSplit(adapters=ADAPTERS, min_samples=3, frozen_agents=frozenset({"critic"}))
    [share] = plan_policy(_policy_batch(), split, num_dp=1)
    assert share.stepping == ("s",) and share.dropped == {"team": 2, "v": 2}
    [mini] = share.minis
    assert mini.rows.names("agent") == ["solver"] * 3
    assert mini.counts == {"num_tokens": 1 + 2 + 3, "num_seqs": 3}  # the loss normalises over kept rows


def test_the_summary_names_each_l2_policys_stepping_adapters_on_every_rank():
    layouts = {"base": WorkerGroupLayout(ranks=[0, 1], tp=2)}
    split = BatchSplit(adapters=ADAPTERS, min_samples=3, frozen_agents=frozenset({"critic"}))
    out = rank_batches(_policy_batch(), {"base": split}, layouts, world_size=2)
    assert [r.summary.stepped_adapters for r in out] == [{"base": ("s",)}] * 2
    # every adapter below the minimum: no rows left, nothing steps
    split = BatchSplit(adapters=ADAPTERS, min_samples=4, frozen_agents=frozenset({"critic"}))
    out = rank_batches(_policy_batch(), {"base": split}, layouts, world_size=2)
    assert out[0].summary.stepped_adapters == {"base": ()} and out[0].shares["base"].minis == []
    # a policy without adapters: no entry, its share steps every parameter
    out = rank_batches(_policy_batch(), {"base": BatchSplit()}, layouts, world_size=2)
    assert out[0].summary.stepped_adapters == {} and out[0].shares["base"].stepping is None


def test_a_push_carries_the_adapters_that_stepped_since_the_last_push():
    versions = WeightVersions(["base", "full"], sync_every=2)
    assert versions.to_push("base") is None  # nothing recorded yet: every adapter
    versions.trained(["base", "full"], {"base": ("s",)})
    versions.trained(["base", "full"], {"base": ("v",)})
    assert versions.due() == ["base", "full"]
    assert versions.to_push("base") == ["s", "v"] and versions.to_push("full") is None
    assert versions.pushed("base") == 1
    assert versions.to_push("base") == []  # a push resets what is due
    versions.trained(["base"], {"base": ()})
    assert versions.to_push("base") == []


def test_min_samples_is_validated_with_its_key():
    with pytest.raises(ValueError, match=r"policies.<p>.lora.min_samples must be >= 0, got -1"):
        LoraConfig(min_samples=-1)


def test_a_resume_that_adds_an_adapter_is_refused_naming_it(tmp_path):
    from megamarl.runtime.checkpoint import ADAPTER_STEPS_FILE, check_adapters

    file = tmp_path / "step_000002" / "policies" / "base" / ADAPTER_STEPS_FILE
    check_adapters(file, "base", ["s", "v"])  # a checkpoint saved before per-adapter counts: not checked
    file.parent.mkdir(parents=True)
    file.write_text('{"s": 2, "v": 0}')
    check_adapters(file, "base", ["s", "v"])
    with pytest.raises(
        ValueError, match=r"has no LoRA adapters \['new'\] of policy 'base' \(it has \['s', 'v'\]\)"
    ):
        check_adapters(file, "base", ["new", "s", "v"])


def test_each_adapter_has_the_version_of_its_last_push_and_its_samples_are_as_stale_as_it():
    from megamarl.driver.streaming import EpisodeGroup, behind

    agents = {"solver": ("base", "s"), "verifier": ("base", "v")}
    versions = WeightVersions(["base", "full"], sync_every=1, adapters=agents)
    versions.pushed("base"), versions.pushed("full")  # start-up: every adapter, version 1
    versions.trained(["base"], {"base": ("s",)})
    versions.pushed("base", versions.to_push("base"))  # version 2 carries s only
    assert versions.serving() == {"base": 2, "full": 1, "base/solver": 2, "base/verifier": 1}

    def sample(agent, policy, version):
        return Sample("t", "e", agent, policy, 0, prompt_ids=[1], response_ids=[2], weight_version=version)

    serving = versions.serving()
    # the verifier's adapter has not changed since version 1: its version-1 sample is fresh
    assert behind(serving, sample("verifier", "base", 1)) == 0
    assert behind(serving, sample("solver", "base", 1)) == 1
    assert (
        behind(serving, sample("other", "full", 0)) == 1 and behind(serving, sample("x", "frozen", 0)) is None
    )
    group = EpisodeGroup("t", [sample("verifier", "base", 1), sample("solver", "base", 2)])
    assert group.staleness(serving) == 0
