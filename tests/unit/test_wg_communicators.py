"""A worker group's process groups: megatron-core's ProcessGroupCollection names more groups than there
are distinct rank sets (with cp = ep = 1: tp_cp is tp, dp_cp is dp, tp_ep_pp is mp; embd is pp at two
stages), and on GPUs each group made is an NCCL communicator with its own device buffers. Each rank set
is made once (``build_worker_group``), and the plan counts one communicator per distinct multi-rank set
(``num_communicators`` / ``nccl_reserve_bytes``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megamarl.parallel.network import free_port
from megamarl.parallel.placement import (
    NCCL_COMMUNICATOR_BYTES,
    WorkerGroupLayout,
    build_worker_group,
    communicator_rank_sets,
    nccl_reserve_bytes,
    num_communicators,
    wg_enumerations,
)


def test_distinct_multi_rank_sets_of_a_tp2_pp2_dp2_group():
    layout = WorkerGroupLayout(ranks=list(range(8)), tp=2, pp=2)
    names = {
        name: sorted({tuple(sorted(g)) for g in e if 0 in g}) for name, e in wg_enumerations(layout).items()
    }
    assert names["tp_cp"] == names["tp"] == [(0, 1)] and names["dp_cp"] == names["dp"] == [(0, 2)]
    assert names["tp_ep_pp"] == names["mp"] == [(0, 1, 4, 5)] and names["embd"] == names["pp"] == [(0, 4)]
    assert communicator_rank_sets(layout, 0) == {
        (0, 1),
        (0, 4),
        (0, 2),
        (0, 1, 4, 5),
        (0, 1, 2, 3),
        tuple(range(8)),
    }
    assert num_communicators([layout], 0, world_size=8) == 6 + 1  # and the default (world) group
    other = WorkerGroupLayout(ranks=[8, 9], tp=2, key="placement.worker_groups.b")  # a WG rank 0 is not in
    assert num_communicators([layout, other], 0, world_size=10) == 7
    assert (
        nccl_reserve_bytes([layout, other], 9, world_size=10) == 2 * NCCL_COMMUNICATOR_BYTES
    )  # tp {8, 9}, world
    assert num_communicators([WorkerGroupLayout(ranks=[0])], 0, world_size=1) == 0  # one rank: no peers


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_rank_set_of_a_worker_group_is_made_once(one_rank_world, monkeypatch):
    """A real one-rank gloo world: all 13 named groups are the rank set {0}; one group is made for it."""
    made = []
    real = distributed_c10d.new_group

    def counted(*args, **kwargs):
        made.append(kwargs.get("ranks", args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed_c10d, "new_group", counted)
    monkeypatch.setattr(dist, "new_group", counted)
    wg = build_worker_group("p", WorkerGroupLayout(ranks=[0]))
    assert made == [[0]], made
    pgs = wg.pgs
    assert pgs.tp is pgs.pp is pgs.dp is pgs.cp is pgs.mp is pgs.intra_dist_opt is pgs.embd is pgs.pos_embd
    assert dist.get_world_size(pgs.tp) == 1
