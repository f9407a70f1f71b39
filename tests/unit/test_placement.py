"""Placement: layout validation errors name the key and the numbers; rank layout math is exact."""

import pytest
import torch

from megamarl.parallel import cpu_compat
from megamarl.parallel.placement import (
    PlacementConfig,
    WorkerGroupLayout,
    expert_coords,
    group_enumeration,
    rank_coords,
    wg_enumerations,
)


def test_dp_is_derived_from_ranks():
    layout = WorkerGroupLayout(ranks=[0, 1, 2, 3], tp=2)
    assert (layout.tp, layout.pp, layout.dp) == (2, 1, 2)


def test_tp_pp_dp_must_match_rank_count():
    with pytest.raises(
        ValueError, match=r"placement.worker_groups.actor: tp\*pp\*dp = 2\*2\*2 = 8 differs .* 4"
    ):
        PlacementConfig(
            {
                "actor": WorkerGroupLayout(
                    ranks=[0, 1, 2, 3], tp=2, pp=2, dp=2, key="placement.worker_groups.actor"
                )
            }
        )
    with pytest.raises(ValueError, match=r"3 ranks are not divisible by tp\*pp = 2\*1 = 2"):
        WorkerGroupLayout(ranks=[0, 1, 2], tp=2)


@pytest.mark.parametrize(
    "kwargs, heads, kv, layers, message",
    [
        ({"tp": 2}, 9, 3, 30, r"\.tp=2 does not divide the model's 9 attention heads"),
        ({"tp": 4}, 8, 2, 4, r"\.tp=4 does not divide the model's 2 KV heads"),
        ({"pp": 4}, 8, 8, 30, r"\.pp=4 does not divide the model's 30 layers"),
    ],
)
def test_model_divisibility_errors(kwargs, heads, kv, layers, message):
    ranks = list(range(kwargs.get("tp", 1) * kwargs.get("pp", 1)))
    placement = PlacementConfig({"solver": WorkerGroupLayout(ranks=ranks, **kwargs)})
    with pytest.raises(ValueError, match=r"placement.worker_groups.solver" + message):
        placement.worker_groups["solver"].check_model(num_heads=heads, num_kv_heads=kv, num_layers=layers)


def test_ranks_out_of_range():
    placement = PlacementConfig({"a": WorkerGroupLayout(ranks=[2, 3, 4, 5], tp=2)})
    with pytest.raises(
        ValueError, match=r"placement.worker_groups.a.ranks \[4, 5\] out of range for world size 4"
    ):
        placement.validate_world(4)


def test_overlapping_disaggregated_worker_groups():
    wgs = {"a": WorkerGroupLayout(ranks=[0, 1], tp=2), "b": WorkerGroupLayout(ranks=[1, 2], tp=2)}
    with pytest.raises(
        ValueError,
        match=r"disaggregated .*worker_groups.b.ranks and .*worker_groups.a.ranks overlap at rank 1",
    ):
        PlacementConfig(wgs, mode="disaggregated")
    PlacementConfig(wgs, mode="colocated")  # sharing ranks is what colocated means


def test_unknown_mode_lists_allowed():
    with pytest.raises(
        ValueError, match=r"placement.mode='spread' unknown; allowed: \['colocated', 'disaggregated'\]"
    ):
        PlacementConfig({"a": WorkerGroupLayout(ranks=[0])}, mode="spread")


def test_rank_enumeration_follows_megatron_order_on_non_contiguous_ranks():
    # tp fastest, then dp, then pp; mapped onto global ranks 4..11 in a scrambled order.
    ranks = [4, 5, 6, 7, 8, 9, 10, 11]
    layout = WorkerGroupLayout(ranks=ranks, tp=2, pp=2, dp=2)
    assert group_enumeration(layout, ["tp"]) == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert group_enumeration(layout, ["dp"]) == [[4, 6], [5, 7], [8, 10], [9, 11]]
    assert group_enumeration(layout, ["pp"]) == [[4, 8], [5, 9], [6, 10], [7, 11]]
    assert rank_coords(layout, 9) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    odd = WorkerGroupLayout(ranks=[7, 1, 5, 3], tp=2)
    assert group_enumeration(odd, ["tp"]) == [[7, 1], [5, 3]]


def test_expert_grid_redivides_each_stage_as_etp_ep_edp():
    # Per stage tp*dp = 4 ranks = etp 1 x ep 2 x edp 2 (etp fastest, then ep, edp, pp: megatron-core's order)
    layout = WorkerGroupLayout(ranks=list(range(8)), tp=2, pp=2, ep=2, etp=1)
    assert (layout.dp, layout.edp) == (2, 2)
    groups = wg_enumerations(layout)
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["expt_dp"] == groups["intra_expt_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expt_tp"] == [[r] for r in range(8)]
    assert groups["tp_ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["tp_ep_pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert expert_coords(layout, 6) == {"etp": 0, "ep": 0, "edp": 1, "pp": 1}
    assert rank_coords(layout, 6) == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 1}  # dense grid unchanged


def test_without_experts_the_expert_groups_are_the_dense_ones():
    layout = WorkerGroupLayout(ranks=[3, 4, 5, 6, 7, 8, 9, 10], tp=2, pp=2)  # ep 1, etp = tp
    groups = wg_enumerations(layout)
    assert groups["expt_tp"] == groups["tp_ep"] == groups["tp"]
    assert groups["expt_dp"] == groups["dp"] and groups["tp_ep_pp"] == groups["mp"]
    assert groups["ep"] == [[r] for r in layout.ranks]


def test_expert_layout_errors_name_the_key():
    with pytest.raises(ValueError, match=r"policies.p: etp\*ep = 2\*4 does not divide tp\*dp = 2\*2"):
        WorkerGroupLayout(ranks=[0, 1, 2, 3], tp=2, ep=4, key="policies.p")
    with pytest.raises(ValueError, match=r"policies.p.ep must be >= 1, got 0"):
        WorkerGroupLayout(ranks=[0, 1], ep=0, key="policies.p")
    layout = WorkerGroupLayout(ranks=[0, 1, 2, 3], tp=2, ep=2, etp=2, key="policies.p")
    with pytest.raises(ValueError, match=r"policies.p.ep=2 does not divide the model's 3 experts"):
        layout.check_experts(num_experts=3, ffn_hidden_size=8)
    with pytest.raises(ValueError, match=r"policies.p.etp=2 does not divide the experts' intermediate size"):
        layout.check_experts(num_experts=4, ffn_hidden_size=7)


def test_cpu_compat_is_inert_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    assert cpu_compat.enable_cpu_compat() == []
    assert torch.cuda.current_device is before


def test_cpu_compat_patches_exactly_the_listed_places():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    applied = cpu_compat.enable_cpu_compat()
    assert applied == list(cpu_compat.PATCHES)
    assert cpu_compat.patches_in_force() == applied  # read from the patched objects themselves
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.pipeline_parallel import schedules

    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    torch.manual_seed(3)
    state = torch.cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
