"""``parallel.network.host_address``: the one rule for the address senders bind and servers advertise
(environment and socket lookups replaced), and ``gloo_group`` binding the chosen address."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megamarl.parallel import network
from megamarl.parallel.network import gloo_group, host_address

INTERFACES = {"eth0": "10.0.0.5", "ib0": "192.168.7.5", "lo": "127.0.0.1"}
ROUTES = {"node0": "10.0.0.5", "10.0.0.1": "10.0.0.5", "localhost": "127.0.0.1", "8.8.8.8": "172.16.0.5"}


@pytest.fixture
def lookups(monkeypatch):
    """This node: interfaces eth0, ib0, lo; a route to node0 (the rendezvous host) leaving from eth0,
    the default route from 172.16.0.5. Records what was looked up."""
    asked = []

    def interface_address(name):
        asked.append(("interface", name))
        if name not in INTERFACES:
            raise OSError(19, "No such device")
        return INTERFACES[name]

    def route_source(host):
        asked.append(("route", host))
        if host not in ROUTES:
            raise OSError(101, "Network is unreachable")
        return ROUTES[host]

    monkeypatch.setattr(network, "interface_address", interface_address)
    monkeypatch.setattr(network, "interfaces", lambda: ["lo", "eth0", "ib0", "ib1"])
    monkeypatch.setattr(network, "route_source", route_source)
    return asked


def test_the_operators_address_wins(lookups):
    env = {"MEGAMARL_HOST_ADDR": "10.9.9.9", "GLOO_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "node0"}
    assert host_address(multi_node=True, environ=env) == "10.9.9.9"
    assert host_address(multi_node=False, environ=env) == "10.9.9.9"
    assert lookups == []


def test_one_node_stays_on_loopback(lookups):
    assert (
        host_address(multi_node=False, environ={"GLOO_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "node0"})
        == "127.0.0.1"
    )
    assert lookups == []


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth0"}, "192.168.7.5"),  # gloo's first
        ({"NCCL_SOCKET_IFNAME": "ib0,eth0"}, "192.168.7.5"),  # the first of a list
        ({"NCCL_SOCKET_IFNAME": "=ib0"}, "192.168.7.5"),  # NCCL's exact-match prefix
        ({"NCCL_SOCKET_IFNAME": "eth"}, "10.0.0.5"),  # NCCL reads names as prefixes
        ({"NCCL_SOCKET_IFNAME": "ib"}, "192.168.7.5"),  # ib1 has no IPv4 address: the first that has one
        ({"GLOO_SOCKET_IFNAME": "ib1,ib0"}, "192.168.7.5"),
        (
            {"NCCL_SOCKET_IFNAME": "^docker,lo", "MASTER_ADDR": "node0"},
            "10.0.0.5",
        ),  # an exclusion list names none
    ],
)
def test_the_interface_the_collectives_use(lookups, env, expected):
    assert host_address(multi_node=True, environ=env) == expected


def test_a_named_interface_without_an_address_is_an_error(lookups):
    with pytest.raises(
        RuntimeError,
        match=r"^GLOO_SOCKET_IFNAME=ib9: no interface it names has an IPv4 address "
        r"on this node \(interfaces: \['lo', 'eth0', 'ib0', 'ib1'\]\); fix it or "
        r"set MEGAMARL_HOST_ADDR",
    ):
        host_address(multi_node=True, environ={"GLOO_SOCKET_IFNAME": "ib9"})
    with pytest.raises(
        RuntimeError, match=r"^NCCL_SOCKET_IFNAME==eth: no interface"
    ):  # exact: there is no "eth"
        host_address(multi_node=True, environ={"NCCL_SOCKET_IFNAME": "=eth"})


def test_the_route_to_the_control_groups_host(lookups):
    assert host_address(multi_node=True, environ={"MASTER_ADDR": "node0"}) == "10.0.0.5"
    assert lookups == [("route", "node0")]


def test_a_local_rendezvous_host_falls_back_to_the_default_route(lookups):
    """On the rendezvous node MASTER_ADDR may resolve to loopback (Debian's 127.0.1.1 hostname):
    the default route's source address instead."""
    assert host_address(multi_node=True, environ={"MASTER_ADDR": "localhost"}) == "172.16.0.5"
    assert host_address(multi_node=True, environ={"MASTER_ADDR": "unknown-host"}) == "172.16.0.5"
    assert host_address(multi_node=True, environ={}) == "172.16.0.5"


def test_no_routable_address_is_an_error(lookups, monkeypatch):
    monkeypatch.setitem(ROUTES, "8.8.8.8", "127.0.0.1")
    with pytest.raises(RuntimeError, match="set MEGAMARL_HOST_ADDR or GLOO_SOCKET_IFNAME"):
        host_address(multi_node=True, environ={"MASTER_ADDR": "localhost"})


def test_no_route_and_one_address_takes_that_address(lookups, monkeypatch):
    """A rendezvous node whose name maps to loopback, on a network without a default route (an
    isolated cluster fabric, the tests' namespace nodes): its only non-loopback address."""
    monkeypatch.setattr(network, "interfaces", lambda: ["lo", "eth0", "ib1"])
    monkeypatch.delitem(ROUTES, "8.8.8.8")
    assert host_address(multi_node=True, environ={"MASTER_ADDR": "localhost"}) == "10.0.0.5"
    monkeypatch.setattr(network, "interfaces", lambda: ["lo", "eth0", "ib0"])  # two: ambiguous
    with pytest.raises(RuntimeError, match=r"addresses: \['10.0.0.5', '192.168.7.5'\]"):
        host_address(multi_node=True, environ={"MASTER_ADDR": "localhost"})


def test_interface_of_an_address(lookups):
    assert network.interface_of("192.168.7.5") == "ib0"
    assert network.interface_of("10.0.0.5") == "eth0"
    assert network.interface_of("203.0.113.9") is None


def test_real_lookups_on_this_machine():
    """Unpatched: the loopback interface has 127.0.0.1, and the route to it leaves from it."""
    assert network.interface_address("lo") == "127.0.0.1" and "lo" in network.interfaces()
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    with pytest.raises(OSError):
        network.interface_address("no-such-if0")


def test_gloo_group_binds_the_given_address():
    timeout = datetime.timedelta(seconds=30)
    for address in ("127.0.0.1", None):
        group = gloo_group(dist.HashStore(), 0, 1, timeout, address=address)
        tensor = torch.arange(4.0)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([tensor], opts).wait()
        assert torch.equal(tensor, torch.arange(4.0))


def test_pin_gloo_interface_only_for_several_nodes_and_never_over_the_operator(lookups):
    one_node = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}
    assert network.pin_gloo_interface(one_node) is None and "GLOO_SOCKET_IFNAME" not in one_node
    two_nodes = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}
    pinned = dict(two_nodes)
    assert network.pin_gloo_interface(pinned) == "eth0" and pinned["GLOO_SOCKET_IFNAME"] == "eth0"
    given = {**two_nodes, "GLOO_SOCKET_IFNAME": "ib0"}
    assert network.pin_gloo_interface(given) is None and given["GLOO_SOCKET_IFNAME"] == "ib0"
    nat = {**two_nodes, "MEGAMARL_HOST_ADDR": "203.0.113.9"}  # no interface holds it: gloo left alone
    assert network.pin_gloo_interface(nat) is None and "GLOO_SOCKET_IFNAME" not in nat
