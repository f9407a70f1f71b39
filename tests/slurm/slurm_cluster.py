"""A real one-node Slurm cluster for the ``slurm`` test tier: munged, slurmctld and slurmd from Debian's
packages, started as root in a private directory and stopped at the end.

Nothing here is faked: jobs go through ``sbatch``/``srun`` exactly as on a site cluster. What differs
from a site is only what makes a test fast and private, all of it in this file's ``slurm.conf``, never
in the template:

* its own munge key and socket, state, spool, pid and log files under the test's tmp dir, free ports
  for slurmctld and slurmd, ``ClusterName=megamarl-test``: nothing collides with a site's daemons or a
  second run;
* ``AuthInfo=cred_expire=CRED_EXPIRE_S``: a requeued job may start again only ``cred_expire`` seconds
  after it ended (120 s by default); ``SchedulerParameters=sched_interval`` and ``MinJobAge`` short so
  that it starts as soon as it may and a finished job stays visible to ``scontrol`` for the test;
* ``proctrack/linuxproc`` and ``task/none``: no cgroup set-up; ``SlurmdParameters=config_overrides``
  declares at least 2 CPUs, which a 2-rank CPU job asks for, even on a 1-core machine.

``ensure_installed`` installs ``slurm-wlm`` and ``munge`` with apt when they are missing and this is root
on a Debian-like system (6 s here with a warm apt cache; 16 s with the recommended packages);
otherwise it says why not and the tier skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun")
PACKAGES = ("slurm-wlm", "munge")
# The smallest credential lifetime slurmctld accepts (22.05 rejects lower values and falls back to
# 120 s; measured by starting it with each value): it is also a requeued job's wait before its restart.
CRED_EXPIRE_S = 5
START_TIMEOUT_S = 60
APT_TIMEOUT_S = 300  # one apt-get call


def ensure_installed() -> str | None:
    """None when this can run the cluster (root, the Slurm and munge binaries now on PATH), else why not."""
    if os.geteuid() != 0:
        return (
            "the one-node Slurm cluster runs slurmctld/slurmd as root (SlurmUser=root): run the tests as root"
        )
    if all(shutil.which(b) for b in BINARIES):
        return None
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge not installed and no apt-get to install them (Debian/Ubuntu packages)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    try:  # bounded: without a reachable package mirror apt may wait long before failing; that is a skip
        done = subprocess.run(
            install, check=False, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
        )
        if (
            done.returncode != 0
        ):  # a stale package index: refresh it once, as scripts/setup.sh does for bubblewrap
            subprocess.run(
                ["apt-get", "update", "-qq"], check=False, env=env, capture_output=True, timeout=APT_TIMEOUT_S
            )
            done = subprocess.run(
                install, check=False, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
            )
    except subprocess.TimeoutExpired as exc:
        return f"{' '.join(exc.cmd[:3])} took over {APT_TIMEOUT_S} s (no package mirror reachable?)"
    if done.returncode != 0 or not all(shutil.which(b) for b in BINARIES):
        return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host. ``env`` points Slurm's commands
    at this cluster (``SLURM_CONF``); ``stop`` ends every daemon it started (and is safe to call twice)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.num_cpus = max(2, os.cpu_count() or 1)
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self.ctld_addr = "127.0.0.1"
        self.node_addrs = [(self.node, "127.0.0.1")]  # (NodeName, NodeAddr) of each slurmd

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log", *(f"spool/{name}" for name, _ in self.node_addrs)):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._start_munged()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_idle()

    def _start_munged(self) -> None:
        """A key of our own (the package's /etc/munge/munge.key belongs to the munge user, and a site's
        key is none of our business); munged refuses keys and directories others can write."""
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = self.root / "munge" / "munge.socket"
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        self._until(lambda: self.munge_socket.exists(), "munged's socket")

    def _write_conf(self) -> None:
        log = self.root / "log"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=megamarl-test",
                    f"SlurmctldHost={self.node}({self.ctld_addr})",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={log / 'slurmctld.log'}",
                    f"SlurmdLogFile={log / 'slurmd-%n.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "MailProg=/bin/true",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/builtin",
                    "SchedulerParameters=sched_interval=1",
                    "MinJobAge=600",
                    "JobRequeue=1",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "SlurmdParameters=config_overrides",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    f"PlugStackConfig={self.root / 'plugstack.conf'}",
                    *(
                        f"NodeName={name} NodeAddr={addr} CPUs={self.num_cpus} State=UNKNOWN"
                        for name, addr in self.node_addrs
                    ),
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (self.root / "plugstack.conf").write_text("")

    def _spawn(self, name: str, argv: list[str], node=None) -> None:
        """Start a daemon here, or inside ``node`` (tests/nodes.py)."""
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon holds it
        popen = subprocess.Popen if node is None else node.popen
        proc = popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self._daemons.append((name, proc))

    def _until(self, ready, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.logs()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s:\n{self.logs()}")
            time.sleep(0.5)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout
            return out.split() == ["idle"] * len(self.node_addrs)

        self._until(idle, f"nodes {[name for name, _ in self.node_addrs]} idle")

    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), env=kwargs.pop("env", self.env), capture_output=True, text=True, check=check, **kwargs
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.root / "log").glob("*"))
            if p.is_file()
        )

    def stop(self) -> None:
        """SIGTERM every daemon (slurmd first, munged last), SIGKILL what is left after 10 s; jobs still
        running are cancelled first so that no training rank outlives the test."""
        if any(name == "slurmctld" and proc.poll() is None for name, proc in self._daemons):
            self.run("scancel", "--full", "--user=root", check=False, timeout=30)
        for _name, proc in reversed(self._daemons):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._daemons = []


class NodeSlurmCluster(SlurmCluster):
    """The same cluster over network-namespace nodes (tests/nodes.py): slurmctld and slurmd ``n0`` on the
    first node, slurmd ``n<i>`` on node i (``NodeName=n<i> NodeAddr=<its address>``); munged stays in the
    host's namespaces (its socket is a file under ``root``, which must be visible in every node: the
    cluster's shared directory). Slurm's commands (``run``) run on the first node, as on a login node."""

    def __init__(self, root: Path, nodes) -> None:
        super().__init__(root)
        self.nodes = nodes
        self.node = nodes[0].name
        self.ctld_addr = nodes[0].addr
        self.node_addrs = [(node.name, node.addr) for node in nodes]

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log", *(f"spool/{node.name}" for node in self.nodes)):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._start_munged()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)], node=self.nodes[0])
        for node in self.nodes:
            self._spawn(
                f"slurmd-{node.name}", ["slurmd", "-D", "-f", str(self.conf), "-N", node.name], node=node
            )
        self._wait_idle()

    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return self.nodes[0].run(
            list(argv),
            env=kwargs.pop("env", self.env),
            cwd=kwargs.pop("cwd", None),
            capture_output=True,
            text=True,
            check=check,
            **kwargs,
        )
