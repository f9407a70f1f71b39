"""``scripts/train.py --show-placement``: the start-up placement computed as every rank of a fake world,
with exact tables for the 4-rank demos and the 64-rank 70b_hetero cluster."""

from __future__ import annotations

import io
from pathlib import Path

from script_loader import load_script  # tests/ helper

from megamarl.cli.configure import load_config
from megamarl.planning.placement_view import show_placement

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "signalling_tiny.yaml"
VLLM_TP2 = [
    "policies.shared.engine.backend=vllm",
    "policies.shared.tp=2",
    "policies.shared.ranks=[0,1]",
    "policies.shared.engine.num_replicas=2",
]


def _show(overrides, path=TINY, **kwargs) -> list[str]:
    out = io.StringIO()
    show_placement(load_config(path, overrides), out=out, **kwargs)
    return out.getvalue().splitlines()


def test_disaggregated_demo_table():
    """TP=2 WG on ranks 0-1, two vLLM servers led by ranks 2 and 3; rank 0 starts nothing."""
    assert _show(VLLM_TP2 + ["policies.shared.engine.ranks=[2,3]"]) == [
        "Engine replicas (4 ranks, 4 per node, 1 node; every rank computed this same plan in a fake world):",
        "policy  replica  leader  ranks  node  devices  tp  colocated  launch",
        "------  -------  ------  -----  ----  -------  --  ---------  ------",
        "shared  0        2       2      0     2        1   no         server",
        "shared  1        3       3      0     3        1   no         server",
        "",
        "Ranks (WG shards as tp/pp/dp coordinates; 'starts': the replicas the rank launches):",
        "rank  node:dev  WG shards           starts                         engine blocks",
        "----  --------  ------------------  -----------------------------  -------------",
        "0     0:0       shared tp0 pp0 dp0  -                              -",
        "1     0:1       shared tp1 pp0 dp0  -                              -",
        "2     0:2       -                   shared#0 server tp1 devices 2  shared#0 tp0",
        "3     0:3       -                   shared#1 server tp1 devices 3  shared#1 tp0",
    ]


def test_colocated_demo_table():
    """The same WG with its two replicas on its own ranks 0 and 1 (ranks 2-3 idle)."""
    lines = _show(VLLM_TP2, world_size=4)
    assert lines[3:5] == [
        "shared  0        0       0      0     0        1   yes        server",
        "shared  1        1       1      0     1        1   yes        server",
    ]
    assert lines[9:] == [
        "0     0:0       shared tp0 pp0 dp0  shared#0 server tp1 devices 0  shared#0 tp0",
        "1     0:1       shared tp1 pp0 dp0  shared#1 server tp1 devices 1  shared#1 tp0",
        "2     0:2       -                   -                              -",
        "3     0:3       -                   -                              -",
    ]


def test_70b_hetero_placement_for_64_ranks(capsys):
    """The cluster config through the command line: 6 planner servers at TP=8 (one per node, led by
    each node's first rank) on the planner's TP8 x PP2 x DP3 shards, 16 executor servers one per GPU."""
    train = load_script("scripts/train.py", name="train_script")
    assert train.main(["--config", str(ROOT / "configs" / "70b_hetero.yaml"), "--show-placement"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == "Engine replicas (64 ranks, 8 per node, 8 nodes; every rank computed this same plan in a fake "
        "world):"
    )
    assert lines[3] == "planner   0        0       0-7    0     0-7      8   yes        server"
    assert lines[8] == "planner   5        40      40-47  5     0-7      8   yes        server"
    assert lines[24] == "executor  15       63      63     7     7        1   yes        server"
    ranks = {line.split()[0]: line for line in lines[29:]}
    assert len(ranks) == 64
    assert ranks["24"].split() == [
        "24",
        "3:0",
        "planner",
        "tp0",
        "pp1",
        "dp0",
        "planner#3",
        "server",
        "tp8",
        "devices",
        "0-7",
        "planner#3",
        "tp0",
    ]
    assert ranks["31"].split() == ["31", "3:7", "planner", "tp7", "pp1", "dp0", "-", "planner#3", "tp7"]
    assert ranks["57"].split() == [
        "57",
        "7:1",
        "executor",
        "tp1",
        "pp0",
        "dp4",
        "executor#9",
        "server",
        "tp1",
        "devices",
        "1",
        "executor#9",
        "tp0",
    ]
    leaders = [r for r, line in ranks.items() if "server" in line]
    assert leaders == [str(r) for r in (0, 8, 16, 24, 32, 40, *range(48, 64))]


def test_a_replica_across_nodes_fails_the_command(capsys):
    train = load_script("scripts/train.py", name="train_script")
    argv = [
        "--config",
        str(ROOT / "configs" / "70b_hetero.yaml"),
        "--show-placement",
        "policies.planner.engine.tp=16",
        "policies.planner.engine.num_replicas=3",
    ]
    assert train.main(argv) == 2  # a placement that cannot be built is a config error
    assert (
        "placement failed: policies.planner.engine.tp=16 (colocated on policies.planner.ranks): replica 0"
        in capsys.readouterr().err
    )
