"""Run untrusted Python (model-written code and tests) isolated by the kernel, not by hooks.

The default path (``isolated=True``) starts each program in bubblewrap (``bwrap``, the sandbox
Flatpak uses), run by the (root) judge, with:

* its own PID, mount, network, IPC and UTS namespaces: the judge and every other process are
  invisible (``/proc`` shows the sandbox's two processes), so nothing can be read from
  ``/proc/<judge>/mem`` or signalled (``os.kill``, ``pidfd_send_signal``) by pid; no network
  interfaces but a down loopback;
* a root file system that is a read-only tmpfs holding only what Python needs: ``/usr`` (with the
  usual ``/bin``, ``/lib`` links), ``/etc/ld.so.cache``, the interpreter's own prefix (at
  ``/python``, started with ``-I -S``: no site-packages, no .pth pointing into the repository), a
  minimal ``/dev``, a fresh ``/proc`` and a private ``/tmp`` (tmpfs of ``file_size_mb``, the cwd).
  The program text arrives as a read-only file copied from an anonymous memfd: the sandbox needs
  no directory on the host, so nothing is left in the host's ``/tmp`` even when the judge is
  SIGKILLed;
* a uid that is not the judge's: ``setpriv`` drops to an unprivileged uid (200000 + judge pid %
  100000, so concurrent judges do not share a process budget) with no capabilities, empty bounding
  set and ``no_new_privs``; ``unshare --user`` then puts the program in a user namespace of its own
  where that uid maps only to itself;
* rlimits that every descendant inherits (address space, CPU seconds, file size, open files and
  processes; ``RLIMIT_NPROC`` holds because the uid is not root). cgroups are not used: this
  machine mounts cgroup v1 controllers (hybrid), and rlimits under a non-root uid are what the
  issue names for that case; memory is thus bounded per process (``memory_mb`` x ``num_procs`` in
  the worst case), not for the tree as a whole;
* the whole tree killed at the end: bwrap's pid 1 exits when the program exits (or bwrap is
  killed at the deadline, ``--die-with-parent`` also fires when the judge dies), and the kernel
  kills everything left in a PID namespace whose init is gone: ``fork``/``setsid``/double-fork
  children cannot outlive the run.

Why bubblewrap and not hand-written ``unshare``/``mount`` calls: it is small, audited and
packaged everywhere, and does the mount set-up (pivot_root, read-only remounts, tmpfs, data files
from fds) that would otherwise be our own code. It runs privileged (as the root judge) because an
unprivileged uid cannot reach the interpreter under ``/root/.pyenv``; the uid drop happens inside.
``scripts/setup.sh`` installs Debian's ``bubblewrap`` when it is missing.

Output is read in bounded chunks with a deadline: stdout, stderr and the judge's channel are pipes
read by a selector loop; more than ``max_output_mb`` on stdout or the channel kills the run
(``output_limit``), so a flood cannot grow the judge, and a child holding a pipe open cannot make
the judge wait past ``timeout_s``.

``isolated=False`` is the old path, kept only as the explicit ``env.kwargs.unsafe_inprocess``
opt-in and for the side-by-side benchmark: a subprocess with rlimits, an audit hook (PEP 578,
a tripwire and not a boundary: ``_posixsubprocess.fork_exec`` and ``dir_fd`` paths go around it),
``unshare -n`` when root, in a host temp dir named after the judge's pid (removed at the next run
when that pid is gone).
"""

from __future__ import annotations

import functools
import glob
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

# Binds the channel fd and (old path only) installs the audit hook, then runs main.py.
_BOOTSTRAP = textwrap.dedent(
    r'''
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
    '''
)

_UID_BASE = 200000  # sandbox uids: _UID_BASE + judge pid % 100000 (no passwd entry needed)
_MB = 1024 * 1024


class SandboxUnavailableError(RuntimeError):
    """Isolation cannot be set up here (no bwrap, no namespaces, not root)."""


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0  # wall clock; the whole process tree is killed at the deadline
    cpu_s: int = 4  # RLIMIT_CPU per process
    memory_mb: int = 512  # RLIMIT_AS per process
    file_size_mb: int = 8  # RLIMIT_FSIZE, and the size of the private /tmp
    num_procs: int = 64  # RLIMIT_NPROC of the sandbox uid
    network_namespace: bool = True  # unsafe_inprocess path only: ``unshare -n`` when root
    max_output_chars: int = 4000  # stderr kept for feedback messages
    max_output_mb: float = 4.0  # stdout (and channel) read before the run is killed: judge memory bound

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "num_procs", "max_output_chars",
                    "max_output_mb"):
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
    missing = [tool for tool in ("bwrap", "setpriv", "unshare") if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not found (install Debian's bubblewrap: scripts/setup.sh does; "
                "util-linux has setpriv/unshare)")
    if os.geteuid() != 0:
        return "the isolated sandbox needs a root judge (to drop candidates to another uid)"
    probe = _run_isolated("print(6 * 7)", SandboxConfig(timeout_s=20), stdin=None, channel=False)
    if probe.stdout.strip() != "42":
        return f"a probe run failed ({probe.status}, rc {probe.returncode}): {probe.stderr.strip()[-300:]}"
    return None


def run_python(code: str, config: SandboxConfig | None = None, *, stdin: bytes | None = None,
               channel: bool = False, isolated: bool = True) -> SandboxResult:
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
    fds = [_memfd("main.py", code.encode()), _memfd("bootstrap.py", _BOOTSTRAP.encode())]
    stdin_fd = _memfd("stdin", stdin) if stdin is not None else subprocess.DEVNULL
    chan_r, chan_w = os.pipe() if channel else (None, None)
    command = [
        "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--ro-bind", prefix, "/python", "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", str(config.file_size_mb * _MB), "--tmpfs", "/tmp",
        "--perms", "0444", "--ro-bind-data", str(fds[0]), "/sandbox/main.py",
        "--perms", "0444", "--ro-bind-data", str(fds[1]), "/sandbox/bootstrap.py",
        "--remount-ro", "/", "--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
        "--",
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--",
        "unshare", "--user", "--map-current-user", "--",
        python, "-I", "-S", "-B", "/sandbox/bootstrap.py", "/sandbox/main.py", "/tmp",
        str(chan_w) if channel else "-", "nohook",
    ]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            command, env=env, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_limits(config), start_new_session=True,  # noqa: PLW1509 - setrlimit only, no locks
            pass_fds=tuple(fds) + ((chan_w,) if channel else ()),
        )
    finally:
        for fd in fds + ([stdin_fd] if stdin is not None else []) + ([chan_w] if channel else []):
            os.close(fd)
    return _collect(proc, config, chan_r)


def _limits(config: SandboxConfig):
    def apply() -> None:  # in the child before exec: inherited by bwrap and every descendant
        resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_s, config.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (config.memory_mb * _MB, config.memory_mb * _MB))
        resource.setrlimit(resource.RLIMIT_FSIZE, (config.file_size_mb * _MB, config.file_size_mb * _MB))
        resource.setrlimit(resource.RLIMIT_NPROC, (config.num_procs, config.num_procs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _collect(proc: subprocess.Popen, config: SandboxConfig, chan_r: int | None) -> SandboxResult:
    """Read stdout/stderr/channel in bounded chunks until EOF or the deadline; kill the tree then."""
    deadline = time.monotonic() + config.timeout_s
    cap = int(config.max_output_mb * _MB)
    keep_err = config.max_output_chars * 4  # bytes; enough for max_output_chars of UTF-8
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray()}
    if chan_r is not None:
        streams[chan_r] = bytearray()
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
                    del buffer[:-keep_err]
                elif len(buffer) > cap:
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
        ok=status == "ok", status=status, returncode=returncode, stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace")[-config.max_output_chars:],
        channel=streams[chan_r].decode(errors="replace") if chan_r is not None else "",
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
        owner = os.path.basename(path)[len(_TMP_PREFIX):].split("-")[0]
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
        command = [*prefix, sys.executable, "-I", "-B", bootstrap, script, root,
                   str(chan_w) if channel else "-", "hook"]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                command, cwd=root, env=env, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=_limits(config), start_new_session=True,  # noqa: PLW1509 - setrlimit only
                pass_fds=(chan_w,) if channel else (),
            )
        finally:
            if stdin is not None:
                os.close(stdin_fd)
            if channel:
                os.close(chan_w)
        result = _collect(proc, config, chan_r)
        _kill_group(proc)  # stragglers of its session (it runs as root: nothing else stops them)
        return result
