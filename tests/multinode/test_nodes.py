"""The node fixture itself (tests/nodes.py): addresses, hostnames, private /dev/shm and /tmp, the shared
directory, traffic between nodes and nowhere else, a node's death, a pulled link, and clean-up (also when
the process that made the cluster is killed). About 5 s."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import SUBNET, cluster, nodes_permitted  # tests/ helper

pytestmark = [pytest.mark.multinode]

PY = sys.executable
# A TCP listener on $ADDR:$PORT that answers "<hostname>" to each connection.
SERVE = textwrap.dedent("""
    import os, socket
    srv = socket.create_server((os.environ["ADDR"], int(os.environ["PORT"])))
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.sendall(socket.gethostname().encode()); conn.close()
""")
DIAL = (
    "import socket, sys\n"
    "try:\n"
    "    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "    print(c.recv(100).decode())\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__)\n"
)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    shared = tmp_path_factory.mktemp("shared")  # under /tmp: the fixture binds it back over the private /tmp
    with cluster(2, shared) as nodes:
        yield nodes, shared


def _out(node, cmd) -> str:
    return node.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def _dial(node, addr: str, port: int, timeout_s: float = 5.0) -> str:
    return _out(node, [PY, "-c", DIAL, addr, str(port), str(timeout_s)])


def test_addresses_hostnames_and_names(nodes):
    nodes, _ = nodes
    for i, node in enumerate(nodes):
        assert (node.name, node.addr) == (f"n{i}", f"{SUBNET}.{i + 1}")
        assert _out(node, "hostname") == node.name
        assert f"inet {node.addr}/24" in _out(node, "ip -4 addr show dev eth0")
        assert "state UNKNOWN" in _out(node, "ip link show lo") or "UP" in _out(node, "ip link show lo")
        # its own hostname and the others' resolve to their eth0 addresses (never 127.0.1.1)
        names = "(socket.gethostname(), 'n0', 'n1')"
        resolved = _out(
            node, [PY, "-c", f"import socket; print(*(socket.gethostbyname(h) for h in {names}))"]
        )
        assert resolved == f"{node.addr} {SUBNET}.1 {SUBNET}.2"
        assert _out(node, "ip -4 route") == f"{SUBNET}.0/24 dev eth0 proto kernel scope link src {node.addr}"


def test_own_name_on_loopback_as_debian_writes_it(tmp_path):
    if reason := nodes_permitted():
        pytest.skip(reason)
    with cluster(2, tmp_path, own_name_on_loopback=True) as (n0, n1):
        names = "(socket.gethostname(), 'n0', 'n1')"
        program = f"import socket; print(*(socket.gethostbyname(h) for h in {names}))"
        assert _out(n0, [PY, "-c", program]) == f"127.0.1.1 127.0.1.1 {n1.addr}"
        assert _out(n1, [PY, "-c", program]) == f"127.0.1.1 {n0.addr} 127.0.1.1"


def test_private_shm_and_tmp_shared_dir(nodes):
    nodes, shared = nodes
    n0, n1 = nodes
    _out(n0, "echo n0 > /dev/shm/probe && echo n0 > /tmp/probe")
    assert _out(n0, "cat /dev/shm/probe /tmp/probe") == "n0\nn0"
    assert _out(n1, "ls -A /dev/shm") == ""  # nothing of n0's, nothing of the host's
    assert not Path("/tmp/probe").exists() and not Path("/dev/shm/probe").exists()
    assert _out(n1, "test -e /tmp/probe || echo absent") == "absent"
    # the shared directory (under /tmp here) and the repository are the same files on every node
    _out(n0, f"echo from-n0 > {shared}/file")
    assert _out(n1, f"cat {shared}/file") == "from-n0" == (shared / "file").read_text().strip()
    repo = Path(__file__).resolve().parents[2]
    assert _out(n1, ["ls", str(repo / "scripts" / "train.py")]) == str(repo / "scripts" / "train.py")
    assert _out(n1, [PY, "-c", "print(1)"]) == "1"  # the venv's interpreter


def test_traffic_between_nodes_only(nodes):
    nodes, _ = nodes
    n0, n1 = nodes
    server = n1.popen(
        [PY, "-c", SERVE],
        env={**os.environ, "ADDR": n1.addr, "PORT": "5555"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "listening"
        assert _dial(n0, n1.addr, 5555) == "n1"
        assert _dial(n0, "n1", 5555) == "n1"  # by name
        assert _dial(n0, "127.0.0.1", 5555) == "ConnectionRefusedError"  # n0's loopback is its own
        # the host's addresses are not reachable from a node: no route out of the switch
        host = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"], check=True, capture_output=True, text=True
        ).stdout.split()
        for addr in [w.split("/")[0] for w in host if "/" in w and w[0].isdigit()]:
            assert _dial(n0, addr, 22, 1.0) in ("OSError", "TimeoutError"), addr  # ENETUNREACH
        # a pulled cable: connections time out while it is down and work again once it is back
        n1.link_down()
        assert _dial(n0, n1.addr, 5555, 1.0) in ("TimeoutError", "OSError")
        n1.link_up()
        deadline = time.monotonic() + 10
        while (answer := _dial(n0, n1.addr, 5555, 1.0)) != "n1" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answer == "n1"
    finally:
        server.kill()
        server.wait()


def test_kill_all_leaves_the_node_usable(nodes):
    nodes, _ = nodes
    n0, n1 = nodes
    procs = [n1.popen("sleep 300 & sleep 300 & wait"), n1.popen(["sleep", "300"])]
    time.sleep(0.3)
    listing = n1.ps()
    assert [line.endswith(" sleep 300") for line in listing.splitlines()].count(True) == 3
    assert "sleep 300" not in n0.ps()
    assert len(n1.kill_all()) >= 4  # two sleeps and their shell, a third sleep
    assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert n1.pids() == []
    assert _out(n1, "hostname") == "n1"  # the node stays, a relaunch may use it


def test_clean_up_also_when_the_owner_is_killed(tmp_path):
    if reason := nodes_permitted():
        pytest.skip(reason)
    tests = Path(__file__).resolve().parents[1]
    program = (
        f"import sys, time; sys.path.insert(0, {str(tests)!r}); from nodes import cluster\n"
        f"with cluster(2, {str(tmp_path)!r}) as ns:\n"
        "    ns[0].popen(['sleep', '300']); ns[1].popen(['sleep', '300'])\n"
        "    print(*(n.init_pid for n in ns), ns[0]._switch_pid, flush=True); time.sleep(300)"
    )
    owner = subprocess.Popen([PY, "-c", program], stdout=subprocess.PIPE, text=True)
    inits = [int(p) for p in owner.stdout.readline().split()]
    assert len(inits) == 3  # the two nodes' inits and the switch's holder
    with _pinned(inits) as namespaces:
        owner.kill()  # no finally, no atexit: the kernel's PR_SET_PDEATHSIG and --kill-child must clean up
        owner.wait()
        deadline = time.monotonic() + 10
        while _holding(namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _holding(namespaces) == []
    assert not list(Path("/run").glob("megamarl-node.*"))


@contextlib.contextmanager
def _pinned(pids: list[int]) -> Iterator[set[tuple[int, int]]]:
    """The net, mount and PID namespaces of ``pids`` (less this process's own), held open: a freed
    namespace's number is reused at once (a sandbox on the other test worker got it, and its
    processes were counted here), a held one's is not. Yields their (device, inode) keys."""
    with contextlib.ExitStack() as held:
        keys = set()
        for pid, kind in itertools.product(pids, ("net", "mnt", "pid")):
            fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
            held.callback(os.close, fd)
            keys.add(_key(os.fstat(fd)))
        yield keys - {_key(os.stat(f"/proc/self/ns/{kind}")) for kind in ("net", "mnt", "pid")}


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _holding(namespaces: set[tuple[int, int]]) -> list[int]:
    """Host pids of processes in any of ``namespaces``: when none is left, the namespaces (and the
    veths, the bridge and the tmpfs mounts in them) go with the last open descriptor."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(_key(os.stat(f"/proc/{entry}/ns/{k}")) in namespaces for k in ("net", "mnt", "pid")):
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_context_exit_removes_everything(tmp_path):
    if reason := nodes_permitted():
        pytest.skip(reason)
    with contextlib.ExitStack() as pins:
        with pytest.raises(RuntimeError, match="boom"), cluster(2, tmp_path) as ns:
            ns[0].popen(["sleep", "300"])
            namespaces = pins.enter_context(_pinned([n.init_pid for n in ns]))
            raise RuntimeError("boom")  # a failing test
        assert _holding(namespaces) == []
