"""Engine placement (megamarl.rollout.engine_placement): exact replica blocks, launch resolution and
the errors, each naming its config key; load-time checks of policies.<p>.engine.launch/ranks."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from script_loader import load_script  # tests/ helper

from megamarl.cli.configure import load_config
from megamarl.config import ClusterConfig, EngineConfig
from megamarl.driver.schedules import overlaps_training
from megamarl.parallel.placement import placement_of
from megamarl.planning.dryrun import dry_run
from megamarl.rollout.engine_placement import (
    ReplicaPlacement,
    placement_rows,
    placement_table,
    plan_engines,
    ranks_per_node,
    replicas_led_by,
    resolve_launch,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "signalling_tiny.yaml"  # one policy "shared" on every rank, hf engine
HETERO = ROOT / "configs" / "70b_hetero.yaml"
VLLM_TP2 = ["policies.shared.engine.backend=vllm", "policies.shared.tp=2", "policies.shared.ranks=[0,1]"]


def _plan(overrides, world_size, per_node=None, path=TINY):
    return plan_engines(load_config(path, overrides), world_size, per_node or world_size)


def test_disaggregated_two_replicas_on_ranks_2_and_3():
    """The 4-rank demo: a TP=2 WG trains on ranks 0-1, two TP=1 vLLM servers on ranks 2 and 3."""
    plan = _plan(
        VLLM_TP2 + ["policies.shared.engine.num_replicas=2", "policies.shared.engine.ranks=[2,3]"], 4
    )
    assert plan == {
        "shared": [
            ReplicaPlacement("shared", 0, (2,), 0, (2,), False, "server"),
            ReplicaPlacement("shared", 1, (3,), 0, (3,), False, "server"),
        ]
    }
    assert replicas_led_by(plan, 0) == [] and replicas_led_by(plan, 3) == [plan["shared"][1]]
    assert placement_rows(plan) == [
        ("shared", "0", "2", "2", "0", "2", "1", "no", "server"),
        ("shared", "1", "3", "3", "0", "3", "1", "no", "server"),
    ]


def test_colocated_two_replicas_on_the_wg_ranks():
    plan = _plan(VLLM_TP2 + ["policies.shared.engine.num_replicas=2"], 4)
    assert plan["shared"] == [
        ReplicaPlacement("shared", 0, (0,), 0, (0,), True, "server"),
        ReplicaPlacement("shared", 1, (1,), 0, (1,), True, "server"),
    ]
    assert placement_table(plan).splitlines() == [
        "policy  replica  leader  ranks  node  devices  tp  colocated  launch",
        "------  -------  ------  -----  ----  -------  --  ---------  ------",
        "shared  0        0       0      0     0        1   yes        server",
        "shared  1        1       1      0     1        1   yes        server",
    ]


def test_tp2_replica_blocks_and_node_local_devices():
    """Two nodes of 2 ranks: replica 1's block (ranks 2-3) sits on node 1, devices 0-1."""
    plan = _plan(
        [
            "policies.shared.engine.backend=vllm",
            "policies.shared.engine.tp=2",
            "policies.shared.engine.num_replicas=2",
        ],
        4,
        per_node=2,
    )
    assert [(r.ranks, r.node, r.devices, r.leader) for r in plan["shared"]] == [
        ((0, 1), 0, (0, 1), 0),
        ((2, 3), 1, (0, 1), 2),
    ]


def test_hetero_70b_plan_for_64_ranks():
    plan = _plan([], 64, per_node=8, path=HETERO)
    planner, executor = plan["planner"], plan["executor"]
    assert [(r.ranks, r.node, r.devices) for r in planner] == [
        (tuple(range(8 * n, 8 * n + 8)), n, tuple(range(8))) for n in range(6)
    ]
    assert [(r.leader, r.node, r.devices) for r in executor] == [
        (48 + i, 6 + i // 8, (i % 8,)) for i in range(16)
    ]
    assert all(r.colocated and r.launch == "server" for r in planner + executor)
    assert [r.policy for r in replicas_led_by(plan, 8)] == ["planner"] and replicas_led_by(plan, 9) == []


@pytest.mark.parametrize(
    "overrides, world, launch",
    [
        ([], 1, "in_process"),  # hf: no server
        (["policies.shared.engine.backend=vllm"], 1, "in_process"),  # one-rank world
        (
            ["policies.shared.engine.backend=vllm"],
            2,
            "in_process",
        ),  # quickstart shape: 1 replica, WG from rank 0
        (["policies.shared.engine.backend=vllm", "policies.shared.engine.num_replicas=2"], 2, "server"),
        (
            ["policies.shared.engine.backend=vllm", "policies.shared.ranks=[1]"],
            2,
            "server",
        ),  # WG not on rank 0
        (["policies.shared.engine.backend=vllm", "policies.shared.engine.launch=server"], 1, "server"),
        (["policies.shared.engine.num_replicas=2"], 2, "in_process"),  # hf pool in the driver
        (["policies.shared.engine.server_urls=[http://a:1]"], 2, "external"),
    ],
)
def test_resolve_launch(overrides, world, launch):
    cfg = load_config(TINY, overrides)
    wg_ranks = placement_of(cfg, world).worker_groups["shared"].ranks
    assert resolve_launch(cfg.policies["shared"].engine, wg_ranks, world) == launch


def test_in_process_and_external_replicas():
    plan = _plan(["policies.shared.engine.num_replicas=2"], 2)
    assert [(r.ranks, r.devices, r.colocated, r.launch) for r in plan["shared"]] == [
        ((0,), (0,), True, "in_process")
    ] * 2
    plan = _plan(
        [
            "policies.shared.engine.server_urls=[http://a:1,http://b:2]",
            "policies.shared.engine.num_replicas=2",
        ],
        2,
    )
    assert [(r.ranks, r.leader, r.url) for r in plan["shared"]] == [
        ((), None, "http://a:1"),
        ((), None, "http://b:2"),
    ]
    assert replicas_led_by(plan, 0) == []


def test_ranks_per_node():
    assert ranks_per_node(ClusterConfig(gpus_per_node=8), 64, env={}) == 8
    assert ranks_per_node(ClusterConfig(gpus_per_node=8), 4, env={"LOCAL_WORLD_SIZE": "2"}) == 2
    assert ranks_per_node(ClusterConfig(), 4, env={}) == 4


@pytest.mark.parametrize(
    "overrides, world, per_node, message",
    [
        (
            ["policies.shared.engine.backend=vllm", "policies.shared.engine.num_replicas=3"],
            2,
            2,
            (
                "policies.shared.engine.num_replicas=3: num_replicas * tp = 3 * 1 = 3 engine ranks but "
                "policies.shared has 2"
            ),
        ),
        (
            VLLM_TP2 + ["policies.shared.engine.ranks=[4]"],
            4,
            4,
            "policies.shared.engine.ranks [4] out of range for world size 4",
        ),
        (
            VLLM_TP2 + ["policies.shared.engine.tp=2", "policies.shared.engine.ranks=[1,2]"],
            4,
            4,
            "policies.shared.engine.ranks [1] hold shards of policies.shared",
        ),
        (
            VLLM_TP2 + ["policies.shared.engine.tp=2", "policies.shared.engine.ranks=[3,4]"],
            6,
            4,
            "policies.shared.engine.ranks: replica 0 on ranks [3, 4] crosses nodes [0, 1] (4 ranks per node)",
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.engine.tp=2",
                "policies.shared.ranks=[1,2,3,4]",
                "policies.shared.engine.num_replicas=2",
            ],
            6,
            4,
            (
                "policies.shared.engine.tp=2 (colocated on policies.shared.ranks): replica 1 on ranks [3, 4] "
                "crosses nodes"
            ),
        ),
    ],
)
def test_plan_errors_name_the_key(overrides, world, per_node, message):
    with pytest.raises(ValueError) as info:
        _plan(overrides, world, per_node)
    assert message in str(info.value)


def test_a_world_rank_outside_the_wg_ranks_is_found_only_with_the_world():
    """policies.<p>.ranks unset: the WG takes every rank, so any engine rank holds a shard."""
    with pytest.raises(
        ValueError, match=r"policies.shared.engine.ranks=\[1\] but policies.shared.ranks is unset"
    ):
        load_config(TINY, ["policies.shared.engine.backend=vllm", "policies.shared.engine.ranks=[1]"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policies.shared.engine.launch=remote"], "policies.shared.engine.launch='remote' unknown"),
        (
            ["policies.shared.engine.launch=server"],
            (
                "policies.shared.engine.launch=server needs an inference server, which "
                "policies.shared.engine.backend=hf has not"
            ),
        ),
        (["policies.shared.engine.tp=2"], "policies.shared.engine.tp=2 needs an inference server"),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.engine.launch=in_process",
                "policies.shared.ranks=[0]",
                "policies.shared.engine.ranks=[1]",
            ],
            "policies.shared.engine.ranks is set but policies.shared.engine.launch=in_process",
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.engine.launch=in_process",
                "policies.shared.engine.tp=2",
            ],
            "policies.shared.engine.tp=2 with policies.shared.engine.launch=in_process",
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.ranks=[0]",
                "policies.shared.engine.ranks=[1,2]",
            ],
            "policies.shared.engine.ranks has 2 ranks; num_replicas * tp = 1 * 1 = 1",
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.ranks=[0]",
                "policies.shared.engine.num_replicas=2",
                "policies.shared.engine.ranks=[1,1]",
            ],
            "policies.shared.engine.ranks has duplicates: [1, 1]",
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.ranks=[0,1]",
                "policies.shared.engine.ranks=[1]",
            ],
            "policies.shared.engine.ranks [1] hold shards of policies.shared (policies.shared.ranks)",
        ),
        (
            ["policies.shared.engine.server_urls=[http://a:1]", "policies.shared.engine.num_replicas=2"],
            (
                "policies.shared.engine.server_urls has 1 URLs; one per replica: "
                "policies.shared.engine.num_replicas=2"
            ),
        ),
        (
            ["policies.shared.engine.server_urls=[http://:1]"],  # pushes rendezvous on the route to its host
            "policies.shared.engine.server_urls must be http(s) URLs with a host, got ['http://:1']",
        ),
        (
            ["policies.shared.engine.server_urls=[http://a:1]", "policies.shared.engine.launch=in_process"],
            (
                "policies.shared.engine.server_urls connects to external servers: leave "
                "policies.shared.engine.launch=auto"
            ),
        ),
        (
            ["policies.shared.engine.backend=sglang", "policies.shared.engine.launch=in_process"],
            (
                "policies.shared.engine.launch=in_process but policies.shared.engine.backend=sglang has no "
                "in-process engine"
            ),
        ),
    ],
)
def test_load_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(TINY, overrides)
    assert message in str(info.value)


def test_two_policies_cannot_share_disaggregated_engine_ranks(tmp_path):
    cfg = tmp_path / "two.yaml"
    cfg.write_text(TINY.read_text())
    overrides = [
        "+policies.other={model: tiny-random-llama, ranks: [1], engine: {backend: vllm, ranks: [2]}}",
        "policies.shared.ranks=[0]",
        "policies.shared.engine.backend=vllm",
        "policies.shared.engine.ranks=[2]",
    ]
    with pytest.raises(
        ValueError, match=r"policies.other.engine.ranks and policies.shared.engine.ranks share rank 2"
    ):
        load_config(cfg, overrides)


def test_engine_config_defaults_to_auto():
    assert EngineConfig().launch == "auto"


def test_dry_run_places_engines_with_plan_engines():
    """The dry-run's engine memory sits on the ranks the start-up plan gives (one source of truth),
    and a replica crossing a node is an error there too (it used to be a warning)."""
    cfg = load_config(HETERO, [])
    report = dry_run(
        cfg, overlaps_training=overlaps_training(cfg.trainer), console=Console(file=io.StringIO(), width=200)
    )
    plan = plan_engines(cfg, 64, 8)
    assert {name: e.replicas for name, e in report.engines.items()} == {
        name: [list(r.ranks) for r in replicas] for name, replicas in plan.items()
    }
    cfg = load_config(HETERO, ["policies.planner.engine.tp=16", "policies.planner.engine.num_replicas=3"])
    with pytest.raises(
        ValueError,
        match=r"policies.planner.engine.tp=16 \(colocated on policies.planner.ranks\): "
        r"replica 0 on ranks \[0, 1, .*\] crosses nodes \[0, 1\] \(8 ranks per node\)",
    ):
        dry_run(
            cfg,
            overlaps_training=overlaps_training(cfg.trainer),
            console=Console(file=io.StringIO(), width=200),
        )


def test_train_py_checks_the_engine_plan_before_loading_models(monkeypatch, capsys):
    """The pre-flight check of scripts/train.py plans the engines for WORLD_SIZE: a placement that
    cannot be built exits 2 with the key named, before any model is built."""
    train = load_script("scripts/train.py", name="train_script")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = [
        "--config",
        str(TINY),
        "policies.shared.engine.backend=vllm",
        "policies.shared.engine.num_replicas=3",
    ]
    assert train.main(argv) == 2
    assert (
        "config error: policies.shared.engine.num_replicas=3: num_replicas * tp = 3 * 1 = 3"
        in capsys.readouterr().err
    )
