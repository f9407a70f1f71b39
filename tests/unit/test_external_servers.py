"""External engine servers (``engine.server_urls``) in the fleet: fed by the training ranks like
disaggregated servers (so a replica that was unreachable is re-synced by a push when it answers again),
started by nobody here; and the pool's stall keys. tests/multinode/test_link_down_run.py runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megamarl.cli.configure import load_config
from megamarl.parallel.network import free_port
from megamarl.rollout.engine_placement import plan_engines, ranks_per_node
from megamarl.rollout.engines.sglang import SGLangClient
from megamarl.rollout.replicas.policy import PolicyReplicas
from megamarl.rollout.servers import fleet as fleet_module
from megamarl.rollout.servers.fleet import build_fleet

ROOT = Path(__file__).resolve().parents[2]
URLS = ["http://127.0.0.1:30001", "http://10.0.0.5:30002"]


def _cfg(*overrides: str):
    external = (
        "policies.shared.engine.backend=sglang",
        f"policies.shared.engine.server_urls=[{','.join(URLS)}]",
        "policies.shared.engine.num_replicas=2",
        "agents.sender.sampling.allowed_tokens=[]",
        "agents.receiver.sampling.allowed_tokens=[]",
        "policies.shared.seq_len=128",
    )
    return load_config(ROOT / "configs" / "signalling_tiny.yaml", [*external, *overrides])


@pytest.fixture
def world():
    """A one-rank gloo world (the fleet's address exchange and ``PolicyReplicas`` are collective)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fleet(cfg, tmp_path):
    plan = plan_engines(cfg, 1, ranks_per_node(cfg.cluster, 1))
    return build_fleet(cfg, plan=plan, rank=0, world_size=1, run_dir=tmp_path, control_group=None)


def test_external_servers_are_fed_by_the_fleet_and_started_by_nobody(tmp_path, world, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fleet = _fleet(_cfg(), tmp_path)
    assert fleet is not None and fleet.serves("shared")
    servers = fleet.policies["shared"]
    assert servers.external and not servers.colocated and not servers.hands_over
    assert fleet.local == {}  # no rank starts or restarts them
    fleet.wait_ready()
    assert servers.urls == URLS  # kept through the address exchange
    assert fleet.table()[1]["url"] == URLS[1]
    fleet.close()


def test_the_push_rendezvous_is_on_the_route_to_the_servers(tmp_path, world, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("MEGAMARL_HOST_ADDR", raising=False)
    routes = {"127.0.0.1": "127.0.0.1", "10.0.0.5": "10.0.0.1"}
    monkeypatch.setattr(fleet_module, "route_source", routes.__getitem__)
    fleet = _fleet(_cfg(), tmp_path)
    assert fleet.rendezvous_address("shared") == "10.0.0.1"  # not loopback: replica 1 is on another node
    monkeypatch.setenv("MEGAMARL_HOST_ADDR", "10.9.9.9")
    assert fleet.rendezvous_address("shared") == "10.9.9.9"
    fleet.close()


def test_the_pool_of_external_servers_takes_the_stall_keys(tmp_path, world, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.engine.stall_s=3", "policies.shared.engine.health_patience_s=5")
    fleet = _fleet(cfg, tmp_path)
    fleet.wait_ready()
    replicas = PolicyReplicas(
        cfg, "shared", wg=None, worker=None, fleet=fleet, run_dir=tmp_path, driver_rank=0, control_group=None
    )
    assert replicas.served
    pool = replicas.connect()
    assert pool.stall_s == 3
    assert [r.base_url for r in pool.replicas] == URLS
    assert all(isinstance(r, SGLangClient) and r.health_patience_s == 5 for r in pool.replicas)
    fleet.close()


@pytest.mark.parametrize("key,value", [("stall_s", 0), ("health_patience_s", -1), ("stall_s", "nan")])
def test_the_stall_keys_are_positive(key, value):
    with pytest.raises(ValueError, match=rf"policies\.shared\.engine\.{key} must be"):
        load_config(ROOT / "configs" / "signalling_tiny.yaml", [f"policies.shared.engine.{key}={value}"])
