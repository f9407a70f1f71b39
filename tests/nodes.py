"""Nodes of a cluster on one machine, for the ``multinode`` test tier and for users (docs/cluster.md).

``cluster(n, shared)`` starts ``n`` nodes. A node is a set of Linux namespaces held by one process, its
init (PID 1 of the node's PID namespace, reaping orphans as a host's init does):

* network: its own ``eth0`` with address ``10.77.0.(i+1)/24`` (``SUBNET``), a veth pair into a bridge
  that lives in a namespace of its own (the "switch"): no address or route of the host is touched, and
  traffic between nodes stays on addresses this fixture created. Loopback is up. There is no default
  route and no way out of the switch;
* UTS: hostname ``n0``, ``n1``, ...; every node's ``/etc/hosts`` names all nodes (a cluster's DNS), so
  ``gethostbyname("n1")`` is n1's address everywhere and a node's own hostname resolves to its
  ``eth0`` address (or, with ``own_name_on_loopback``, to 127.0.1.1 as on a stock Debian host);
* mount: a private tmpfs on ``/dev/shm`` and on ``/tmp``; every other path (the repository, the venvs,
  the model cache under ``~/.cache``) is the host's, at the same path. ``shared`` (and ``keep``) stay
  visible at their paths even when they lie under ``/tmp`` (pytest's ``tmp_path``): they are bound back
  over the private tmpfs. That is the cluster's shared filesystem;
* PID and IPC: ``ps`` inside a node lists the node's processes only.

Every command runs through ``nsenter`` into all of them (``Node.popen``, ``Node.run``). ``Node.kill_all``
SIGKILLs every process of the node (it "dies"; the node itself stays, a relaunch may use it);
``Node.link_down``/``link_up`` take the switch side of its veth down and up (a pulled cable: packets
are dropped silently, as on a real fabric). The context's exit kills everything and the namespaces
vanish with their last process (veths, bridge and tmpfs with them), also when the test fails or is
interrupted; if the test process itself is killed, each holder gets SIGKILL from the kernel
(``PR_SET_PDEATHSIG``) and the node's init with it (``unshare --kill-child``).

``nodes_permitted()`` is None where this works (root, util-linux ``unshare``/``nsenter``, iproute2, a
kernel that allows veth and bridge devices), else the reason, which the tier skips with.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

SUBNET = "10.77.0"  # node i is SUBNET.(i+1)/24; the switch has no address
PREFIX_LEN = 24
BRIDGE = "br0"
START_TIMEOUT_S = 30
TOOLS = ("unshare", "nsenter", "ip")
PRIVATE = ("/dev/shm", "/tmp")  # a tmpfs of each node's own
REPOSITORY = Path(__file__).resolve().parents[1]


def _host_paths() -> list[Path]:
    """The repository, this interpreter's environment and the model cache, where they lie under a
    private path (a clone in /tmp, ``MEGAMARL_CACHE`` in a fresh temporary directory): a cluster's
    shared filesystem shows them on every node, so the nodes keep them at their paths."""
    from megamarl.models.packaged import cache_dir

    cache = Path(cache_dir()).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    paths = [REPOSITORY, Path(sys.prefix).resolve(), cache]
    return [p for p in paths if any(p.is_relative_to(d) for d in PRIVATE)]


_PR_SET_PDEATHSIG = 1

# The node's init: PID 1 of its PID namespace reaps the orphans reparented to it (a sleep would leave
# zombies that kill_all would then keep finding). The holder script has set the node up before it.
_INIT = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.5)\n"
)

# Run by the node's init before it becomes the init: $1 hostname, $2 hosts file, $3.. paths to keep.
_SETUP = r"""
set -eu
name=$1 hosts=$2; shift 2
hostname "$name"
ip link set lo up
mount --bind "$hosts" /etc/hosts
stage=$(mktemp -d /run/megamarl-node.XXXXXX 2>/dev/null || mktemp -d /var/tmp/megamarl-node.XXXXXX)
mount -t tmpfs -o mode=0700 tmpfs "$stage"
i=0
for path in "$@"; do  # bind what must stay visible aside, before the private tmpfs hide it
    mkdir "$stage/$i"; mount --bind "$path" "$stage/$i"; i=$((i+1))
done
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
i=0
for path in "$@"; do
    mkdir -p "$path"; mount --move "$stage/$i" "$path"; i=$((i+1))
done
umount "$stage"; rmdir "$stage"
echo ready
"""


def _die_with_parent() -> None:
    """In the holder, before exec: SIGKILL when the process that started it dies (a killed pytest)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@functools.cache
def nodes_permitted() -> str | None:
    """None when ``cluster`` can run here, else the reason it cannot (the tier's skip reason)."""
    if sys.platform != "linux":
        return f"network-namespace nodes need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network-namespace nodes need root (unshare --net, veth and bridge devices, mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"network-namespace nodes need {', '.join(missing)} (util-linux, iproute2)"
    probe = (
        "ip link add pa type veth peer name pb && ip link add name probebr type bridge && ip link set pa "
        "master probebr "
        "&& mount -t tmpfs tmpfs /dev/shm && hostname probe"
    )
    try:
        done = subprocess.run(
            [
                "unshare",
                "--net",
                "--uts",
                "--mount",
                "--ipc",
                "--pid",
                "--fork",
                "--mount-proc",
                "sh",
                "-c",
                probe,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"network-namespace nodes: the probe failed: {exc}"
    if done.returncode != 0:
        return f"network-namespace nodes are not permitted here: {done.stderr.strip()[-300:]}"
    return None


def _start_holder(argv: list[str]) -> subprocess.Popen:
    """A holder process whose stdout says ``ready`` once its namespaces are set up."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 (prctl only)
    )
    lines = []
    for line in proc.stdout:  # ends at EOF: the setup failed
        if line.strip() == "ready":
            return proc
        lines.append(line)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{argv[-3:]} did not start (exit {proc.returncode}): {''.join(lines)[-1000:]}")


def _child_pid(pid: int) -> int:
    """The one child of ``pid`` (the node's init, forked by ``unshare --fork``)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise RuntimeError(f"holder {pid} has no child after {START_TIMEOUT_S} s")


class Node:
    """One node: ``name`` (its hostname), ``addr`` (its eth0 IPv4 address); commands run inside it."""

    def __init__(self, index: int, *, holder: subprocess.Popen, switch_pid: int) -> None:
        self.index = index
        self.name = f"n{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.holder = holder
        self.init_pid = _child_pid(holder.pid)
        self.pid_ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        # Namespace numbers are reused as soon as a namespace is freed (a sandbox on the other test
        # worker gets the same pid:[N]): holding the namespace open keeps the number ours until _stop,
        # and a pidfd says when the init, and with it every process of the node, has exited.
        self._pid_ns_fd = os.open(f"/proc/{self.init_pid}/ns/pid", os.O_RDONLY)
        self._init_fd = os.pidfd_open(self.init_pid)
        self.veth = f"vn{index}"  # the switch's end; the node's end is eth0
        self._switch_pid = switch_pid
        self._started: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Node({self.name}, {self.addr})"

    def command(self, cmd: Sequence[str] | str, *, cwd: str | os.PathLike | None = None) -> list[str]:
        """``cmd`` (argv, or a shell line) wrapped to run inside this node, in ``cwd`` (default: this
        process's working directory, which must be visible in the node)."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        return [
            "nsenter",
            "-t",
            str(self.init_pid),
            "--net",
            "--uts",
            "--mount",
            "--ipc",
            "--pid",
            f"--wd={where}",
            "--",
            *argv,
        ]

    def popen(
        self,
        cmd: Sequence[str] | str,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        **kw,
    ) -> subprocess.Popen:
        """``subprocess.Popen`` of ``cmd`` inside the node (``env`` None: this process's environment)."""
        proc = subprocess.Popen(self.command(cmd, cwd=cwd), env=env, **kw)
        self._started.append(proc)
        return proc

    def run(
        self,
        cmd: Sequence[str] | str,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        **kw,
    ) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``cmd`` inside the node (keywords as there: check, timeout, ...)."""
        return subprocess.run(self.command(cmd, cwd=cwd), env=env, **kw)  # noqa: PLW1510 (the caller's check)

    def pids(self, *, with_init: bool = False) -> list[int]:
        """Host pids of the node's live processes, its init excluded unless ``with_init``."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or (int(entry) == self.init_pid and not with_init):
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != self.pid_ns:
                    continue
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # dead, its init reaps it
            except OSError:  # it exited meanwhile
                continue
            found.append(int(entry))
        return found

    def ps(self) -> str:
        """``ps`` inside the node: its processes, as the node sees them (pid 1 is its init)."""
        return self.run(
            ["ps", "-eo", "pid,ppid,rss,etime,args", "--width", "1000"],
            capture_output=True,
            text=True,
            check=False,
            cwd="/",
        ).stdout

    def kill_all(self, *, timeout_s: float = 10.0) -> list[int]:
        """SIGKILL every process of the node (the node dies; the node, its address and mounts stay) and
        wait until none is left. Returns the host pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while True:
            # the nsenter parents outside the node first: one not yet forked into the node would
            # otherwise start its command after the scan
            for proc in self._started:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=timeout_s)
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [p for p in pids if p not in killed]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes {pids} outlived SIGKILL for {timeout_s} s")
            time.sleep(0.05)
        return killed

    def link_down(self) -> None:
        """Take the switch's end of the node's veth down: the node is unreachable, its processes live."""
        self._switch(["ip", "link", "set", self.veth, "down"])

    def link_up(self) -> None:
        self._switch(["ip", "link", "set", self.veth, "up"])

    def _switch(self, argv: list[str]) -> None:
        subprocess.run(
            ["nsenter", "-t", str(self._switch_pid), "--net", "--", *argv],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )

    def _stop(self) -> str | None:
        """Kill the node and wait until its init has exited; the reason if it would not."""
        with contextlib.suppress(Exception):
            self.kill_all()
        self.holder.kill()  # the init dies with it (--kill-child), and with the init the namespaces
        self.holder.wait()
        self.holder.stdout.close()
        return _kill_and_wait(self._init_fd, f"{self.name}'s init {self.init_pid}", close=[self._pid_ns_fd])


def _kill_and_wait(pidfd: int, what: str, *, close: Sequence[int] = ()) -> str | None:
    """SIGKILL the process behind ``pidfd`` and wait for its exit (the kernel delivers --kill-child's
    SIGKILL only after the holder is reaped, so on a loaded host the init outlived the context's exit).
    A PID namespace's init exits after every other process in it, so its exit means the node is empty."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    exited = select.select([pidfd], [], [], START_TIMEOUT_S)[0]
    for fd in (pidfd, *close):
        os.close(fd)
    return None if exited else f"{what} outlived SIGKILL for {START_TIMEOUT_S} s"


def _hosts_file(num_nodes: int, index: int, *, own_name_on_loopback: bool) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [
        f"{'127.0.1.1' if own_name_on_loopback and i == index else f'{SUBNET}.{i + 1}'} n{i}"
        for i in range(num_nodes)
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def cluster(
    n: int, shared: Path, *, keep: Sequence[Path] = (), own_name_on_loopback: bool = False
) -> Iterator[list[Node]]:
    """``n`` nodes on one switch; ``shared`` (created if missing) and ``keep`` visible in all of them at
    their paths. Everything is stopped and removed when the context exits, however it exits.
    ``own_name_on_loopback``: each node's /etc/hosts maps its own hostname to 127.0.1.1, as Debian's
    installer writes it (the others' names still resolve to their addresses): a process that takes
    ``gethostbyname(gethostname())`` for its address advertises loopback."""
    if not 1 <= n <= 250:
        raise ValueError(f"cluster: n={n}, must be 1..250 (one /24)")
    reason = nodes_permitted()
    if reason is not None:
        raise RuntimeError(reason)
    shared = Path(shared).resolve()
    shared.mkdir(parents=True, exist_ok=True)
    visible = []
    for path in sorted(
        {shared, *(Path(p).resolve() for p in keep), *_host_paths()}, key=lambda p: len(p.parts)
    ):
        if not any(path.is_relative_to(outer) for outer in visible):  # inside one already kept: kept with it
            visible.append(path)
    nodes: list[Node] = []
    switch = switch_fd = None
    with tempfile.TemporaryDirectory(prefix="megamarl-nodes-") as scratch:
        try:
            switch = _start_holder(
                [
                    "unshare",
                    "--net",
                    "--fork",
                    "--kill-child",
                    "--",
                    "sh",
                    "-c",
                    f"set -e; ip link add name {BRIDGE} type bridge; ip link set {BRIDGE} up; "
                    + "echo ready; exec sleep infinity",
                ]
            )
            switch_fd = os.pidfd_open(_child_pid(switch.pid))
            for i in range(n):
                hosts = Path(scratch) / f"hosts-n{i}"
                hosts.write_text(_hosts_file(n, i, own_name_on_loopback=own_name_on_loopback))
                holder = _start_holder(
                    [
                        "unshare",
                        "--net",
                        "--uts",
                        "--mount",
                        "--ipc",
                        "--pid",
                        "--fork",
                        "--mount-proc",
                        "--kill-child",
                        "--propagation",
                        "private",
                        "--",
                        "sh",
                        "-c",
                        f"{_SETUP}\nexec {shlex.quote(sys.executable)} -c " + shlex.quote(_INIT),
                        "megamarl-node",
                        f"n{i}",
                        str(hosts),
                        *map(str, visible),
                    ]
                )
                node = Node(i, holder=holder, switch_pid=switch.pid)
                nodes.append(node)
                node._switch(
                    [
                        "ip",
                        "link",
                        "add",
                        node.veth,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        "eth0",
                        "netns",
                        str(node.init_pid),
                    ]
                )
                node._switch(["ip", "link", "set", node.veth, "master", BRIDGE, "up"])
                node.run(
                    f"ip addr add {node.addr}/{PREFIX_LEN} dev eth0 && ip link set eth0 up",
                    check=True,
                    capture_output=True,
                    timeout=START_TIMEOUT_S,
                    cwd="/",
                )
            yield nodes
        finally:
            stuck = [node._stop() for node in nodes]
            if switch is not None:
                switch.kill()
                switch.wait()
                switch.stdout.close()
            if switch_fd is not None:
                stuck.append(_kill_and_wait(switch_fd, "the switch"))
            if any(stuck):
                raise RuntimeError(f"cluster exit: {'; '.join(filter(None, stuck))}")
