"""Run untrusted Python (model-written code and tests) in a constrained subprocess.

Layers, each stopping a different failure; what each does NOT stop is said plainly:

1. ``python -I -B`` in a fresh temporary directory (cwd), minimal environment, new session (the
   whole process group is killed on timeout).
2. ``resource.setrlimit`` in ``preexec_fn``: CPU seconds (infinite loops -> SIGXCPU), address
   space (memory hogs -> MemoryError), file size, open files, and NPROC (fork bombs). NPROC is per
   *user* and is not enforced for root (CAP_SYS_RESOURCE), hence layer 3 also denies forking.
3. An audit hook (``sys.addaudithook``, PEP 578) installed by a bootstrap before the code runs:
   denies opening files for writing, creating, removing or renaming paths outside the temp dir,
   creating sockets, spawning processes (``os.fork``, ``os.system``, ``subprocess.Popen``,
   ``os.exec*``, ``os.posix_spawn``), loading native code via ``ctypes``, and reading or listing
   anything outside the temp dir, the Python installation and the process's own ``/proc`` entry
   (so a candidate cannot read a judge's data files or ``/proc/<parent>``). Audit hooks are a
   tripwire against accidents and naive code, not a security boundary: code that corrupts the
   interpreter (e.g. via a C extension that is already loaded) can get around them.
4. Network namespace: when running as root and ``unshare -n`` works, the process runs with no
   network interfaces at all (a kernel boundary, unlike the audit hook).
5. A wall-clock timeout (sleeps and blocking calls do not burn CPU seconds).

For hostile code at scale use a container/gVisor/firejail per sandbox; this module is what runs
on a laptop with no privileges beyond the above.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

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

    # reads are allowed only where the interpreter itself needs them (stdlib, site-packages)
    READABLE = [ROOT] + sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                sys.exec_prefix, sys.base_exec_prefix)}) + [os.path.realpath("/proc/self")]
    DEVICES = {"/dev/null", "/dev/urandom", "/dev/zero"}

    def readable(path):
        if isinstance(path, int):
            return True  # an fd already open: stdin/stdout/stderr or the judge's channel
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
    sys.argv = ["main.py"]
    sys.addaudithook(hook)
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__channel__": channel})
    '''
)


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 4
    memory_mb: int = 512  # address space
    file_size_mb: int = 8
    num_procs: int = 64  # RLIMIT_NPROC (per user; root ignores it)
    network_namespace: bool = True  # use ``unshare -n`` when available
    max_output_chars: int = 4000

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "num_procs", "max_output_chars"):
            if getattr(self, key) <= 0:
                raise ValueError(f"sandbox.{key} must be > 0, got {getattr(self, key)}")


@dataclass
class SandboxResult:
    ok: bool  # exit code 0 within limits
    status: str  # ok | error | timeout | killed
    returncode: int | None
    stdout: str
    stderr: str
    channel: str = ""  # what the program wrote on the judge's channel fd (``channel=True``)


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "-n")`` if this process may create a network namespace, else ()."""
    tool = shutil.which("unshare")
    if tool is None or os.geteuid() != 0:
        return ()
    try:
        ok = subprocess.run([tool, "-n", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (tool, "-n") if ok else ()


def _limits(config: SandboxConfig):
    def apply() -> None:
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_s, config.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (config.memory_mb * mb, config.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (config.file_size_mb * mb, config.file_size_mb * mb))
        resource.setrlimit(resource.RLIMIT_NPROC, (config.num_procs, config.num_procs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, config: SandboxConfig | None = None, *, stdin: bytes | None = None,
               channel: bool = False) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandbox; never raises for anything the code does.

    ``stdin``: bytes fed to the program's stdin (else /dev/null). ``channel``: also give the
    program an anonymous file (no path anywhere, so it cannot be opened by name) whose fd number
    is the global ``__channel__``; its content comes back as ``SandboxResult.channel``. A judge
    harness reports on it so that the program's stdout never mixes with results.
    """
    config = config or SandboxConfig()
    with tempfile.TemporaryDirectory(prefix="megamarl-sbx-") as root, tempfile.TemporaryFile() as chan:
        script, bootstrap = os.path.join(root, "main.py"), os.path.join(root, ".bootstrap.py")
        with open(script, "w") as f:
            f.write(code)
        with open(bootstrap, "w") as f:
            f.write(_BOOTSTRAP)
        prefix = _unshare_prefix() if config.network_namespace else ()
        fds = (chan.fileno(),) if channel else ()
        command = [*prefix, sys.executable, "-I", "-B", bootstrap, script, root, str(fds[0]) if fds else "-"]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            command, cwd=root, env=env, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_limits(config),
            start_new_session=True, pass_fds=fds,
        )
        try:
            out, err = proc.communicate(input=stdin, timeout=config.timeout_s)
            status = "ok" if proc.returncode == 0 else ("killed" if proc.returncode < 0 else "error")
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            status = "timeout"
        chan.seek(0)
        # RLIMIT_FSIZE already bounds what the program could write here
        reported = chan.read().decode(errors="replace") if channel else ""
    limit = config.max_output_chars
    return SandboxResult(
        ok=status == "ok", status=status, returncode=proc.returncode,
        stdout=out.decode(errors="replace")[-limit:], stderr=err.decode(errors="replace")[-limit:],
        channel=reported,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
