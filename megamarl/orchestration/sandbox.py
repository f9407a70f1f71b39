"""Run untrusted Python (model-written code and tests) isolated by the kernel, not by hooks.

The default path (``isolated=True``) starts each program in bubblewrap (``bwrap``), run by the
(root) judge: own PID, mount, network, IPC and UTS namespaces; a read-only root holding only what
Python needs, with a private ``/tmp``, no pty device and the program text copied from an anonymous
memfd; an unprivileged uid with no capabilities (and none to gain: a seccomp filter built by
libseccomp refuses new namespaces, keyrings, io_uring, ptrace, mounts and every socket family but
AF_UNIX); a fresh session keyring; ``oom_score_adj`` 1000; a cgroup per run (memory, tasks, CPU
bandwidth; rlimits alone where no hierarchy is writable, ``tree_limits()`` says which) plus
per-process rlimits; the whole tree killed at the end. Output is read in bounded chunks with a
deadline (more than ``max_output_mb`` on any stream kills the run: ``output_limit``). ``isolated=False`` (the
explicit ``env.kwargs.unsafe_inprocess`` opt-in) is a plain subprocess with rlimits and an audit
hook, a tripwire and not a boundary. ``scripts/setup.sh`` installs bubblewrap and libseccomp2.
The full account (each layer, cgroup v1/v2, why bubblewrap and the filter): docs/design-notes.md,
"megamarl/orchestration/sandbox.py".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import glob
import itertools
import multiprocessing.util
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass, field

# Binds the channel fd and (old path only) installs the audit hook, then runs main.py.
_BOOTSTRAP = textwrap.dedent(
    r"""
    import os, sys
    ROOT = os.path.realpath(sys.argv[2])
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    DENIED = {"os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn", "os.exec",
              "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "socket.__new__",
              "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "os.kill",
              "os.killpg"}
    PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.chmod": 1,
                   "os.chown": 1, "os.link": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                   "os.symlink": 2}

    def inside(path):
        if isinstance(path, int):
            return path in (1, 2)
        try:
            path = os.fsdecode(path)
        except TypeError:
            return False
        real = os.path.realpath(path)
        return real == ROOT or real.startswith(ROOT + os.sep)

    READABLE = [ROOT] + sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                sys.exec_prefix, sys.base_exec_prefix)}) + [os.path.realpath("/proc/self")]
    DEVICES = {"/dev/null", "/dev/urandom", "/dev/zero"}

    def readable(path):
        if isinstance(path, int):
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except TypeError:
            return False
        return real in DEVICES or any(real == r or real.startswith(r + os.sep) for r in READABLE)

    def hook(event, args):
        if event in DENIED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
            if not readable(path):
                raise PermissionError(f"sandbox: reading {path!r} outside the sandbox directory")
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and not readable(args[0]):
                raise PermissionError(f"sandbox: listing {args[0]!r} outside the sandbox directory")
        elif event in PATH_EVENTS:
            for path in args[: PATH_EVENTS[event]]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox directory")

    with open(sys.argv[1]) as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    del f, source
    channel = int(sys.argv[3]) if sys.argv[3] != "-" else None
    hooked = sys.argv[4] == "hook"
    sys.argv = ["main.py"]
    if hooked:
        sys.addaudithook(hook)
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__channel__": channel})
    """
)

_UID_BASE = 200000  # sandbox uids: _UID_BASE + judge pid % 100000 (no passwd entry needed)
_MB = 1024 * 1024


class SandboxUnavailableError(RuntimeError):
    """Isolation cannot be set up here (no bwrap, no namespaces, not root)."""


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0  # wall clock; the whole process tree is killed at the deadline
    cpu_s: int = 4  # RLIMIT_CPU per process
    memory_mb: int = 512  # the tree's memory + swap (cgroup), and RLIMIT_AS per process
    file_size_mb: int = 8  # RLIMIT_FSIZE, and the size of the private /tmp
    num_procs: int = 64  # the tree's tasks (cgroup pids.max), and RLIMIT_NPROC of the sandbox uid
    cpus: float = 1.0  # CPU bandwidth of the whole tree in cores (cgroup): <= cpus x timeout_s CPU-s a run
    network_namespace: bool = True  # unsafe_inprocess path only: ``unshare -n`` when root
    max_output_chars: int = 4000  # stderr kept for feedback messages
    max_output_mb: float = 4.0  # stdout, stderr, channel: read per stream before the run is killed

    def __post_init__(self) -> None:
        for key in (
            "timeout_s",
            "cpu_s",
            "memory_mb",
            "file_size_mb",
            "num_procs",
            "cpus",
            "max_output_chars",
            "max_output_mb",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"sandbox.{key} must be > 0, got {getattr(self, key)}")


@dataclass
class SandboxResult:
    ok: bool  # exit code 0 within limits
    status: str  # ok | error | timeout | killed | output_limit
    returncode: int | None
    stdout: str  # all of it (up to max_output_mb)
    stderr: str  # the last max_output_chars
    channel: str = ""  # what the program wrote on the judge's channel fd (``channel=True``)


@functools.lru_cache(maxsize=1)
def isolation_error() -> str | None:
    """None when isolated runs work here, else why not (probed once per process)."""
    missing = [tool for tool in ("bwrap", "setpriv") if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found (install Debian's bubblewrap: scripts/setup.sh does; "
            "util-linux has setpriv)"
        )
    if os.geteuid() != 0:
        return "the isolated sandbox needs a root judge (to drop candidates to another uid)"
    try:
        _seccomp_program()
    except SandboxUnavailableError as exc:
        return str(exc)
    probe = _run_isolated("print(6 * 7)", SandboxConfig(timeout_s=20), stdin=None, channel=False)
    if probe.stdout.strip() != "42":
        return f"a probe run failed ({probe.status}, rc {probe.returncode}): {probe.stderr.strip()[-300:]}"
    return None


def run_python(
    code: str,
    config: SandboxConfig | None = None,
    *,
    stdin: bytes | None = None,
    channel: bool = False,
    isolated: bool = True,
) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandbox; never raises for anything the code does.

    ``stdin``: bytes fed to the program's stdin (else /dev/null). ``channel``: also give the
    program a pipe, whose fd number is the global ``__channel__``; what it writes there comes back
    as ``SandboxResult.channel``. A judge harness reports on it so that the program's stdout never
    mixes with results. ``isolated=False``: the old audit-hook path (``unsafe_inprocess``).
    Raises ``SandboxUnavailableError`` when ``isolated`` and isolation cannot be set up.
    """
    config = config or SandboxConfig()
    if not isolated:
        return _run_audited(code, config, stdin=stdin, channel=channel)
    reason = isolation_error()
    if reason is not None:
        raise SandboxUnavailableError(f"sandbox: cannot isolate candidate code: {reason}")
    return _run_isolated(code, config, stdin=stdin, channel=channel)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # anonymous: no path anywhere; pass_fds hands it on
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_isolated(code: str, config: SandboxConfig, *, stdin: bytes | None, channel: bool) -> SandboxResult:
    uid = _UID_BASE + os.getpid() % 100000
    prefix = os.path.realpath(sys.base_prefix)
    python = "/python/bin/" + os.path.basename(os.path.realpath(sys.executable))
    fds = [
        _memfd("main.py", code.encode()),
        _memfd("bootstrap.py", _BOOTSTRAP.encode()),
        _memfd("seccomp", _seccomp_program()),
    ]
    stdin_fd = _memfd("stdin", stdin) if stdin is not None else subprocess.DEVNULL
    chan_r, chan_w = os.pipe() if channel else (None, None)
    command = [
        "bwrap",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--ro-bind",
        prefix,
        "/python",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",  # over bwrap's devpts: /dev/ptmx dangles, so no pty (the host's pty/max is global)
        "/dev/pts",
        "--perms",
        "1777",
        "--size",
        str(config.file_size_mb * _MB),
        "--tmpfs",
        "/tmp",
        "--perms",
        "0444",
        "--ro-bind-data",
        str(fds[0]),
        "/sandbox/main.py",
        "--perms",
        "0444",
        "--ro-bind-data",
        str(fds[1]),
        "/sandbox/bootstrap.py",
        "--remount-ro",
        "/",
        "--remount-ro",  # the candidate may not lower its oom_score_adj (a judge without
        "/proc",  # CAP_SYS_RESOURCE, as in a container, cannot set the floor that forbids it)
        "--chdir",
        "/tmp",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--seccomp",  # loaded in the child just before it execs setpriv: the candidate inherits it
        str(fds[2]),
        "--",
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        python,
        "-I",
        "-S",
        "-B",
        "/sandbox/bootstrap.py",
        "/sandbox/main.py",
        "/tmp",
        str(chan_w) if channel else "-",
        "nohook",
    ]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    cgroup = _pool().acquire(config)
    try:
        try:
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_limits(config, cgroup, isolated=True),  # noqa: PLW1509 - os.write/setrlimit/keyctl
                start_new_session=True,
                pass_fds=tuple(fds) + ((chan_w,) if chan_w is not None else ()),  # not None: channel
            )
        finally:
            for fd in (
                fds + ([stdin_fd] if stdin is not None else []) + ([chan_w] if chan_w is not None else [])
            ):
                os.close(fd)
        return _collect(proc, config, chan_r)
    finally:
        if cgroup is not None:
            _pool().release(cgroup)


def _limits(config: SandboxConfig, cgroup: _RunCgroup | None = None, *, isolated: bool = False):
    procs = [f"{path}/cgroup.procs".encode() for path in cgroup.paths] if cgroup is not None else []
    join_session = _keyring_joiner() if isolated else None

    def apply() -> None:  # in the child before exec: inherited by bwrap and every descendant
        for path in procs:  # "0": the writing process; raw os calls only between fork and exec
            _write_raw(path, b"0")
        if join_session is not None:
            join_session()
            _write_raw(b"/proc/self/oom_score_adj", b"1000")  # the OOM killer takes candidates first
        resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_s, config.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (config.memory_mb * _MB, config.memory_mb * _MB))
        resource.setrlimit(resource.RLIMIT_FSIZE, (config.file_size_mb * _MB, config.file_size_mb * _MB))
        resource.setrlimit(resource.RLIMIT_NPROC, (config.num_procs, config.num_procs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _write_raw(path: bytes, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _keyring_joiner():
    """A call that gives the calling process a new anonymous session keyring (resolved before the
    fork: only the syscall runs in the child). The judge's session keyring (systemd services,
    pam_keyinit logins, container runtimes have one) would otherwise be every candidate's: a run
    could store answers there for a later one. The filter refuses keyctl to the candidate anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    number = _seccomp_lib().seccomp_syscall_resolve_name(b"keyctl")
    syscall = libc.syscall
    syscall.restype, syscall.argtypes = ctypes.c_long, [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]

    def join() -> None:
        if syscall(number, 1, None) < 0 and ctypes.get_errno() != errno.ENOSYS:  # KEYCTL_JOIN_SESSION_KEYRING
            raise OSError(ctypes.get_errno(), "sandbox: cannot give the run a session keyring of its own")

    return join


def _collect(proc: subprocess.Popen, config: SandboxConfig, chan_r: int | None) -> SandboxResult:
    """Read stdout/stderr/channel in bounded chunks until EOF or the deadline; kill the tree then."""
    deadline = time.monotonic() + config.timeout_s
    cap = int(config.max_output_mb * _MB)
    keep_err = config.max_output_chars * 4  # bytes; enough for max_output_chars of UTF-8
    assert proc.stdout is not None and proc.stderr is not None  # both are PIPE
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray()}
    if chan_r is not None:
        streams[chan_r] = bytearray()
    num_err_bytes = 0  # stderr keeps only its tail, but all of it counts against the cap
    status = None
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in selector.select(timeout=left):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:  # woken without data after all
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = streams[key.fd]
                buffer += chunk
                if key.fd == err_fd:
                    num_err_bytes += len(chunk)
                    del buffer[:-keep_err]
                if len(buffer) > cap or num_err_bytes > cap:
                    status = "output_limit"
            if status:
                break
    if status is None:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            status = "timeout"
    if status is not None:
        _kill_group(proc)
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if chan_r is not None:
        os.close(chan_r)
    returncode = proc.returncode
    if status is None:  # bwrap reports a signal death of the program as 128 + signal
        status = "ok" if returncode == 0 else ("killed" if returncode < 0 or returncode > 128 else "error")
    stdout, stderr = streams[out_fd], streams[err_fd]
    return SandboxResult(
        ok=status == "ok",
        status=status,
        returncode=returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace")[-config.max_output_chars :],
        channel=streams[chan_r].decode(errors="replace") if chan_r is not None else "",
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the candidate's syscall filter: libseccomp compiles it, bwrap loads it (``--seccomp FD``) ---

# A deny list (everything else is allowed: the candidate is ordinary Python, and an allow list
# breaks with each new libc or interpreter). Refused with EPERM. Why each entry:
_DENIED_SYSCALLS = (
    # namespaces: a new user namespace makes the candidate uid 0 there with a full bounding set and
    # every capability over the namespaces it creates next (net admin, nf_tables, mounts); clone
    # with a CLONE_NEW* flag is refused by _CLONE_NAMESPACE_FLAGS, clone3 hides its flags (ENOSYS:
    # libc falls back to clone)
    "unshare",
    "setns",
    # keyrings outlive the run (the session keyring is fresh per run; the uid's user keyring is not)
    "keyctl",
    "add_key",
    "request_key",
    # kernel attack surface no test harness needs
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    # other processes' memory (none is visible; refused in case one becomes so)
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    # the mount family (each also needs a capability the candidate lacks)
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_tree_attr",
)
# syscalls newer than the libseccomp that may be installed (2.5.4 here): x86_64 numbers
_NEWER_SYSCALLS_X86_64 = {"open_tree_attr": 467}
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# socket(2)/socketpair(2) of any family but AF_UNIX (1): no network at all (bwrap's new network
# namespace has a loopback that is up: refusing AF_INET/AF_INET6 is what makes it unreachable, and
# what keeps TCP buffers, uncharged to a cgroup v1 memory limit, out of reach); no AF_NETLINK
# (nf_tables, routing), AF_PACKET, AF_KEY, AF_VSOCK... AF_UNIX stays: asyncio and multiprocessing
# need socketpair, and in a new network namespace with no host socket bound it reaches nothing.
_AF_UNIX = 1

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE, _SCMP_CMP_MASKED_EQ = 1, 7


def _scmp_errno(code: int) -> int:
    return 0x00050000 | code


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _seccomp_lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SandboxUnavailableError(
            f"libseccomp not found ({exc}): the candidate's syscall filter cannot be built (install "
            "Debian's libseccomp2: scripts/setup.sh does)"
        ) from None
    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ScmpArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes:
    """The compiled BPF program (built once per process). Syscalls of another ABI (i386 via int
    0x80, x32) kill the process: libseccomp's default for a foreign architecture."""
    lib = _seccomp_lib()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SandboxUnavailableError("seccomp_init failed: the candidate's syscall filter cannot be built")
    try:

        def deny(name: str, *conditions: tuple[int, int, int, int], code: int = errno.EPERM) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0 and os.uname().machine == "x86_64":
                number = _NEWER_SYSCALLS_X86_64.get(name, -1)
            if number < 0:
                return  # this architecture has no such syscall
            array = (_ScmpArgCmp * len(conditions))(*(_ScmpArgCmp(*c) for c in conditions))
            rc = lib.seccomp_rule_add_array(ctx, _scmp_errno(code), number, len(conditions), array)
            if rc != 0:
                raise SandboxUnavailableError(f"seccomp: cannot add the rule for {name} ({os.strerror(-rc)})")

        for name in _DENIED_SYSCALLS:
            deny(name)
        deny("clone3", code=errno.ENOSYS)
        for flag in _CLONE_NAMESPACE_FLAGS:
            deny("clone", (0, _SCMP_CMP_MASKED_EQ, flag, flag))
        for name in ("socket", "socketpair"):
            deny(name, (0, _SCMP_CMP_NE, _AF_UNIX, 0))
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SandboxUnavailableError(f"seccomp: cannot export the filter ({os.strerror(-rc)})")
            os.lseek(fd, 0, os.SEEK_SET)
            return os.read(fd, 1 << 20)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


# --- per-run cgroups: limits that hold for the tree as a whole -----------------------------------

_CGROUP_PREFIX = "megamarl-sbx-"
_run_numbers = itertools.count()


@dataclass(frozen=True)
class _Hierarchy:
    """A directory under which this judge may create per-run cgroups, and what it controls."""

    parent: str
    version: int  # 1 (one hierarchy per controller) or 2 (unified)
    controllers: tuple[str, ...] = field(default=())


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@functools.lru_cache(maxsize=1)
def _hierarchies() -> tuple[_Hierarchy, ...]:
    """Where per-run cgroups go: memory and pids are required, cpu is used when present.
    Empty when no hierarchy is writable here (then rlimits alone bound the tree)."""
    try:
        with open("/proc/self/cgroup") as f:
            membership = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return ()
    own_v1 = {c: path for _, names, path in membership for c in names.split(",") if names}
    own_v2 = next((path for _, names, path in membership if not names), None)
    v1, v2 = {}, None
    for fields in mounts:
        tail = fields[fields.index("-") + 1 :]
        root, point = fields[3], fields[4]
        if tail[0] == "cgroup":
            for c in tail[2].split(","):
                if c in ("memory", "pids", "cpu") and c in own_v1:
                    v1[c] = _below(point, root, own_v1[c])
        elif tail[0] == "cgroup2" and own_v2 is not None:
            v2 = _below(point, root, own_v2)
    found = tuple(_Hierarchy(path, 1, (c,)) for c, path in sorted(v1.items()) if path and _can_create(path))
    if {"memory", "pids"} <= {h.controllers[0] for h in found}:
        return found
    if v2 and _enable_v2(v2):
        return (_Hierarchy(v2, 2, ("memory", "pids", "cpu")),)
    return ()


def _below(mount_point: str, mount_root: str, path: str) -> str | None:
    rel = os.path.relpath(path, mount_root)
    return None if rel.startswith("..") else os.path.normpath(os.path.join(mount_point, rel))


def _can_create(parent: str) -> bool:
    probe = os.path.join(parent, f"{_CGROUP_PREFIX}{os.getpid()}-probe")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return False
    return True


def _enable_v2(parent: str) -> bool:
    """v2: the controllers must be enabled for children, which fails (EBUSY) while ``parent``
    holds processes unless it is the root; then the tree falls back to rlimits."""
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if not {"memory", "pids", "cpu"} <= set(enabled):
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
    except OSError:
        return False
    return _can_create(parent)


def tree_limits() -> str:
    """How the sandbox bounds a whole tree here: ``cgroup v1 (cpu, memory, pids)``, ``cgroup v2``
    or ``rlimits`` (per process only)."""
    found = _hierarchies()
    if not found:
        return "rlimits"
    if found[0].version == 2:
        return "cgroup v2"
    return f"cgroup v1 ({', '.join(h.controllers[0] for h in found)})"


@dataclass
class _RunCgroup:
    """One cgroup per hierarchy (v1) or one (v2), reused by this judge's runs one at a time. The
    judge holds a shared ``flock`` on each directory for as long as it owns it: that lock, not a
    pid, is what another judge's sweep asks (a pid it cannot see may live in another PID
    namespace; the lock is released only when no process holds the directory open)."""

    paths: list[str]
    locks: list[int] = field(default_factory=list)

    def apply(self, found: tuple[_Hierarchy, ...], config: SandboxConfig) -> None:
        for hierarchy, path in zip(found, self.paths, strict=True):
            for key, value in _limit_files(hierarchy, path, config):
                _write(os.path.join(path, key), value)

    def kill(self) -> None:
        for path in self.paths:
            _kill_members(path)

    def idle(self) -> bool:
        """No task left in it (the kernel reaps a finished run's namespace asynchronously)."""
        for path in self.paths:
            try:
                with open(f"{path}/cgroup.procs") as f:
                    if f.read().strip():
                        return False
            except OSError:
                return False
        return True

    def remove(self) -> None:
        for path in self.paths:
            _remove_cgroup(path)
        for fd in self.locks:
            os.close(fd)
        self.locks.clear()


class _CgroupPool:
    """Per-run cgroups of this judge. A run takes an idle one (or makes one) and the limits are
    written for its config; when the run ends, whatever is left in it is killed and it goes back
    without waiting for the kernel to reap it (a later run takes it once it is idle). Creating and
    removing a cgroup per run would cost ~5 ms and waiting for the reaping ~6 ms, a fifth of a
    sandboxed process's wall time. The pool's cgroups are removed at exit, or by the next judge's
    sweep when this one is SIGKILLed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[_RunCgroup] = []
        self.pid = os.getpid()
        self.token = uuid.uuid4().hex[:16]  # names this judge's cgroups; the pid is for people
        # at exit, also in multiprocessing children (env workers), which leave through os._exit
        multiprocessing.util.Finalize(None, self.close, exitpriority=10)

    def acquire(self, config: SandboxConfig) -> _RunCgroup | None:
        found = _hierarchies()
        if not found:
            return None
        _sweep_stale_cgroups(found)
        with self.lock:
            cgroup = next((c for c in self.free if c.idle()), None)
            if cgroup is not None:
                self.free.remove(cgroup)
        if cgroup is None:
            cgroup = self._create(found)
        try:
            cgroup.apply(found, config)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def _create(self, found: tuple[_Hierarchy, ...]) -> _RunCgroup:
        cgroup = _RunCgroup([])
        name = f"{_CGROUP_PREFIX}{os.getpid()}-{self.token}-{next(_run_numbers)}"
        try:
            for hierarchy in found:
                path = os.path.join(hierarchy.parent, name)
                os.mkdir(path)
                cgroup.paths.append(path)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                cgroup.locks.append(fd)
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a sweep that saw it unlocked removes it
                if os.fstat(fd).st_nlink == 0 or not os.path.isdir(path):  # a sweep removed it first
                    raise FileNotFoundError(errno.ENOENT, "sandbox: a sweep removed a new cgroup", path)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def release(self, cgroup: _RunCgroup) -> None:
        cgroup.kill()
        with self.lock:
            self.free.append(cgroup)

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherited the pool: the cgroups are its parent's
            return
        with self.lock:
            free, self.free = self.free, []
        for cgroup in free:
            cgroup.remove()


_pools: dict[int, _CgroupPool] = {}


def _pool() -> _CgroupPool:
    """This process's pool (a forked judge, e.g. an env worker, makes its own)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = _CgroupPool()
    return _pools[pid]


def _limit_files(hierarchy: _Hierarchy, path: str, config: SandboxConfig) -> list[tuple[str, str]]:
    memory, tasks = str(config.memory_mb * _MB), str(config.num_procs)
    if hierarchy.version == 2:
        period = 100000
        files = [
            ("memory.max", memory),
            ("pids.max", tasks),
            ("cpu.max", f"{int(config.cpus * period)} {period}"),
        ]
        return files + ([("memory.swap.max", "0")] if os.path.exists(f"{path}/memory.swap.max") else [])
    controller = hierarchy.controllers[0]
    if controller == "memory":  # memory <= memsw (memory + swap) must hold after each write
        files = [("memory.limit_in_bytes", memory)]
        if os.path.exists(f"{path}/memory.memsw.limit_in_bytes"):
            with open(f"{path}/memory.limit_in_bytes") as f:
                raising = int(f.read()) < int(memory)  # a reused cgroup: raise memsw first
            files = (
                [("memory.memsw.limit_in_bytes", memory), *files]
                if raising
                else [*files, ("memory.memsw.limit_in_bytes", memory)]
            )
        return files
    if controller == "pids":
        return [("pids.max", tasks)]
    with open(f"{path}/cpu.cfs_period_us") as f:
        period = int(f.read())
    return [("cpu.cfs_quota_us", str(int(config.cpus * period)))]


def _kill_members(path: str) -> bool:
    """SIGKILL every task of the cgroup at ``path``; True if it had any."""
    try:
        with open(f"{path}/cgroup.procs") as f:
            pids = [int(pid) for pid in f.read().split()]
    except OSError:
        return False
    if pids:
        try:
            _write(f"{path}/cgroup.kill", "1")  # v2: the whole cgroup at once
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return bool(pids)


def _remove_cgroup(path: str, *, within_s: float = 2.0) -> None:
    """Kill whatever is left in the cgroup, then remove it (the kernel reaps asynchronously)."""
    end = time.monotonic() + within_s
    while True:
        _kill_members(path)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > end:
                return  # still busy: the next sweep removes it
            time.sleep(0.01)


def _sweep_stale_cgroups(found: tuple[_Hierarchy, ...]) -> None:
    """Remove the cgroups of judges that died (SIGKILL skips ``remove``): those whose directory
    no process holds locked. Whether the owner's pid is visible proves nothing (a judge in another
    PID namespace sharing this tree has a pid that is not ours). Names without a token (older
    judges, which lock nothing) are left to their own sweeps."""
    for hierarchy in found:
        try:
            names = os.listdir(hierarchy.parent)
        except OSError:
            continue
        for name in names:
            parts = name[len(_CGROUP_PREFIX) :].split("-")
            if not name.startswith(_CGROUP_PREFIX) or len(parts) != 3 or len(parts[1]) != 16:
                continue
            path = os.path.join(hierarchy.parent, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its judge is alive, whatever PID namespace it is in
                os.close(fd)
                continue
            try:  # removed while holding the lock: an owner creating it waits, then sees it gone
                _remove_cgroup(path, within_s=0.2)
            finally:
                os.close(fd)


# --- the old path: env.kwargs.unsafe_inprocess ---------------------------------------------------

_TMP_PREFIX = "megamarl-sbx-"


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "-n")`` if this process may create a network namespace, else ()."""
    tool = shutil.which("unshare")
    if tool is None or os.geteuid() != 0:
        return ()
    try:
        ok = subprocess.run([tool, "-n", "true"], check=False, capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (tool, "-n") if ok else ()


def _sweep_stale_dirs() -> None:
    """Remove temp dirs of judges that died (SIGKILL skips ``TemporaryDirectory`` cleanup)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _TMP_PREFIX + "*")):
        owner = os.path.basename(path)[len(_TMP_PREFIX) :].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(path, ignore_errors=True)


def _run_audited(code: str, config: SandboxConfig, *, stdin: bytes | None, channel: bool) -> SandboxResult:
    _sweep_stale_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}{os.getpid()}-") as root:
        script, bootstrap = os.path.join(root, "main.py"), os.path.join(root, ".bootstrap.py")
        with open(script, "w") as f:
            f.write(code)
        with open(bootstrap, "w") as f:
            f.write(_BOOTSTRAP)
        prefix = _unshare_prefix() if config.network_namespace else ()
        chan_r, chan_w = os.pipe() if channel else (None, None)
        stdin_fd = _memfd("stdin", stdin) if stdin is not None else subprocess.DEVNULL
        command = [
            *prefix,
            sys.executable,
            "-I",
            "-B",
            bootstrap,
            script,
            root,
            str(chan_w) if channel else "-",
            "hook",
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                command,
                cwd=root,
                env=env,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_limits(config),  # noqa: PLW1509 - setrlimit only
                start_new_session=True,
                pass_fds=(chan_w,) if chan_w is not None else (),  # not None: channel
            )
        finally:
            if stdin is not None:
                os.close(stdin_fd)
            if chan_w is not None:  # channel
                os.close(chan_w)
        result = _collect(proc, config, chan_r)
        _kill_group(proc)  # stragglers of its session (it runs as root: nothing else stops them)
        return result
