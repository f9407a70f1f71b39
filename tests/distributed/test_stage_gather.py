"""``stage_gather`` over gloo, 2 ranks: stage 1's sender streams its export to stage 0's sender in
buckets, and stage 0 receives every tensor (names, dtypes, values) in order on its device, its own
stage first: what a PP>1 push into vLLM's one-group ``nccl`` engine does on GPU (there over NCCL).
Relayed (colocated replicas at PP>1): the two stages' leaders swap their stages in pp order, each
ending with the whole model, while a rank whose replica is not targeted still forwards its stage."""

from __future__ import annotations

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _stage(rank: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (f"model.layers.{rank}.w{i}", torch.randn(64, 32, generator=g).to(dtype))
        for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32))
    ]


def _gather(rank: int) -> list | None:
    import itertools

    from megamarl.rollout.weights.stage_gather import forward_device, forward_stage, receive_stage

    device = forward_device(on_gpu=False)
    if rank == 1:
        assert (
            forward_stage(iter(_stage(1)), dst=0, bucket_bytes=10_000, device=device) == 3
        )  # one tensor each
        return None
    got = list(itertools.chain(_stage(0), receive_stage(1, device=device)))
    return [(n, t.dtype, t.device.type, t.clone()) for n, t in got]


def test_stage_one_reaches_stage_zero_in_order():
    got, _ = run_ranks(_gather, 2, timeout_s=120)
    expected = _stage(0) + _stage(1)
    assert [n for n, *_ in got] == [n for n, _ in expected]
    for (_, dtype, device, tensor), (_, want) in zip(got, expected):
        assert dtype == want.dtype and device == "cpu" and torch.equal(tensor, want)


def _relay(rank: int) -> list:
    """Both stages' leaders swap their stages (every replica targeted), then a re-sync of replica 1
    alone: rank 0 still forwards its stage, and feeds nothing."""
    import itertools

    from megamarl.parallel.placement import WorkerGroupLayout
    from megamarl.rollout.weights.stage_gather import forward_device, receive_stage, relay_roles, relay_stage
    from megamarl.rollout.weights.weight_sync import drain

    device, layout, fed = forward_device(on_gpu=False), WorkerGroupLayout([0, 1], pp=2), []
    for leaders in ({0, 1}, {1}):
        role = relay_roles(layout, leaders)[rank]
        named = relay_stage(
            iter(_stage(rank)), destinations=role.destinations, bucket_bytes=10_000, device=device
        )
        if not role.feeds:
            drain(named)
            fed.append(None)
            continue
        stages = [
            named if s == role.stage else receive_stage(role.sources[s], device=device) for s in range(2)
        ]
        fed.append([(n, t.dtype, t.clone()) for n, t in itertools.chain(*stages)])
    return fed


def test_colocated_leaders_swap_stages_in_pp_order():
    fed0, fed1 = run_ranks(_relay, 2, timeout_s=120)
    expected = _stage(0) + _stage(1)
    for got in (fed0[0], fed1[0], fed1[1]):
        assert [n for n, *_ in got] == [n for n, _ in expected]
        for (_, dtype, tensor), (_, want) in zip(got, expected):
            assert dtype == want.dtype and torch.equal(tensor, want)
    assert fed0[1] is None  # replica 0 not targeted: its leader only forwarded stage 0
