"""The address this node's processes bind and advertise to other nodes, chosen in one place.

Weight senders host their rendezvous at it, megamarl's gloo groups bind to it, and an engine server
bound to 0.0.0.0 advertises its URL with it. ``host_address`` tries, in order: ``MEGAMARL_HOST_ADDR``;
127.0.0.1 on one node; the interface ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` names; the source
address of the route to ``MASTER_ADDR``; that of the default route; the node's only non-loopback IPv4
address; and raises otherwise. Invariant: unlike ``gethostbyname(gethostname())`` it never gives a
multi-node run a loopback address unless told to. ``gloo_group`` builds a gloo group bound to the
address; ``listen_address`` maps a listener's host (``""``: loopback on one node, every interface on
several). The rule step by step: docs/design-notes.md, "megamarl/parallel/network.py".
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping
from datetime import timedelta

import torch.distributed as dist

HOST_ADDR_ENV = "MEGAMARL_HOST_ADDR"
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_PUBLIC_PROBE = "8.8.8.8"  # any global address: a UDP connect picks the default route and sends nothing


ANY_HOST = ("0.0.0.0", "::")  # bind addresses that serve other nodes


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (0.0.0.0 or ::, every interface; the default, a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host if host not in ANY_HOST else "", 0))
        return sock.getsockname()[1]


def is_multi_node(environ: Mapping[str, str] | None = None) -> bool:
    """torchrun's view of this run: the world has ranks on other nodes (WORLD_SIZE > LOCAL_WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    return world > int(env.get("LOCAL_WORLD_SIZE") or world)


def listen_address(host: str, *, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(bind, advertise) for a listener that other nodes may reach. ``host`` ``""`` (auto): one node,
    127.0.0.1 for both (nothing else can dial in); several, every interface, advertised at
    ``host_address``. 0.0.0.0 or ``::``: bind it, advertise ``host_address`` (never the wildcard, which
    no peer can dial). Any other address: bind and advertise it as given."""
    multi_node = is_multi_node(environ)
    if not host:
        host = ANY_HOST[0] if multi_node else "127.0.0.1"
    if host in ANY_HOST:
        return host, host_address(multi_node=multi_node, environ=environ)
    return host, host


def host_address(*, multi_node: bool, environ: Mapping[str, str] | None = None) -> str:
    """The address peers reach this node's senders and servers at (module docstring's rules)."""
    env = os.environ if environ is None else environ
    if env.get(HOST_ADDR_ENV):
        return env[HOST_ADDR_ENV]
    if not multi_node:
        return "127.0.0.1"
    for key in IFNAME_ENVS:
        names = _named_interfaces(env.get(key, ""), prefixes=key == "NCCL_SOCKET_IFNAME")
        if names is None:
            continue
        for name in names:
            try:
                return interface_address(name)
            except OSError:
                continue
        raise RuntimeError(
            f"{key}={env[key]}: no interface it names has an IPv4 address on this node "
            f"(interfaces: {interfaces()}); fix it or set {HOST_ADDR_ENV}"
        )
    for host in (env.get("MASTER_ADDR"), _PUBLIC_PROBE):
        if not host:
            continue
        try:
            address = route_source(host)
        except OSError:  # unresolvable, or no route
            continue
        if not ipaddress.ip_address(address).is_loopback:
            return address
    candidates = node_addresses()
    if len(candidates) == 1:
        return candidates[0]
    raise RuntimeError(
        f"no address of this node reachable from other nodes was found (MASTER_ADDR "
        f"{env.get('MASTER_ADDR')!r} is local or unroutable, no default route, this node's "
        f"addresses: {candidates}): set {HOST_ADDR_ENV} or {IFNAME_ENVS[0]}"
    )


def node_addresses() -> list[str]:
    """This node's non-loopback IPv4 addresses, one per interface that has one, in interface order."""
    found = []
    for name in interfaces():
        try:
            address = interface_address(name)
        except OSError:
            continue
        if not ipaddress.ip_address(address).is_loopback and address not in found:
            found.append(address)
    return found


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 ``address`` on this node, None when none does (e.g. a NAT address)."""
    for name in interfaces():
        try:
            if interface_address(name) == address:
                return name
        except OSError:
            continue
    return None


def pin_gloo_interface(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Multi-node, ``GLOO_SOCKET_IFNAME`` unset: set it to the interface holding ``host_address``, so that
    torch's own gloo groups (the world, the control group) bind the address this rule chose. Unpinned,
    gloo binds the address the hostname resolves to: 127.0.1.1 on Debian-style hosts, which peers
    cannot dial (the first collective across nodes hangs). Returns the interface set, or None."""
    env = os.environ if environ is None else environ
    if not is_multi_node(env) or env.get(IFNAME_ENVS[0]):
        return None
    name = interface_of(host_address(multi_node=True, environ=env))
    if name is not None:
        env[IFNAME_ENVS[0]] = name
    return name


def _named_interfaces(value: str, *, prefixes: bool) -> list[str] | None:
    """The interfaces a ``*_SOCKET_IFNAME`` value names, in its order; None when it names none (unset,
    or an exclusion list ``^...``). ``prefixes``: NCCL's reading (``eth`` matches eth0, eth1; ``=``
    makes the list exact)."""
    value = value.strip()
    if not value or value.startswith("^"):
        return None
    if value.startswith("="):
        value, prefixes = value[1:], False
    wanted = [w.strip() for w in value.split(",") if w.strip()]
    if not prefixes:
        return wanted
    present = interfaces()
    return [name for w in wanted for name in present if name.startswith(w)]


def interfaces() -> list[str]:
    """This node's network interface names, in kernel index order."""
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """IPv4 address of network interface ``name`` (OSError when it has none)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def route_source(host: str) -> str:
    """The local address this node's route to ``host`` leaves from (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def gloo_group(store, rank: int, world_size: int, timeout: timedelta, *, address: str | None = None):
    """A gloo process group on ``store`` whose device binds ``address`` (None: gloo's own choice,
    ``GLOO_SOCKET_IFNAME`` or the hostname's address)."""
    if address is None:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
