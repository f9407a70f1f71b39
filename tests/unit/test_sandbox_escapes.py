"""Escape suite: attacks a reward-hacking candidate would try on the code judge (issue #28).

Each attack runs through the real judge (``judge_calls`` / ``judge_stdio``) in the isolated
sandbox; each must score 0 (the real solution scores full marks on the same cases), with the judge
(this test process) alive and nothing left behind: no process of the sandbox uid, no new
``/tmp/megamarl-sbx-*`` entry, no task in the judge's cgroups, no file written outside. Skipped where
isolation cannot be set up; the tree-limit tests also where no cgroup hierarchy is writable.
"""

import ctypes
import ctypes.util
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from megamarl.cli.configure import load_config
from megamarl.orchestration import EnvMaker, Task, sandbox
from megamarl.orchestration.context import Action
from megamarl.orchestration.envs.code import CodeConfig, CodeProblem
from megamarl.orchestration.judge import ExprCase, StdioCase, judge_calls, judge_stdio, parse_assert_tests
from megamarl.orchestration.sandbox import SandboxConfig, isolation_error

pytestmark = pytest.mark.skipif(
    isolation_error() is not None, reason=f"sandbox isolation unavailable here: {isolation_error()}"
)

CONFIG = SandboxConfig(timeout_s=4.0, cpu_s=2, memory_mb=256)
SETUP, CASES = parse_assert_tests("assert scale(2) == 6\nassert scale(-1) == -3\nassert scale(5) == 15\n")
REAL = "def scale(x):\n    return x * 3\n"
FALLBACK = "\ndef scale(x):\n    return 0\n"
JUDGE = os.getpid()


def sandbox_uid(pid: int = JUDGE) -> int:
    return sandbox._UID_BASE + pid % 100000


def processes_of(uid: int) -> list[int]:
    found = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if int(uids[0]) == uid:
            found.append(int(status.split("/")[2]))
    return found


def wait_gone(uid: int, within_s: float = 3.0) -> list[int]:
    """Processes of ``uid`` still alive after ``within_s`` (the kernel tears a PID namespace
    down asynchronously once its init is gone)."""
    end = time.monotonic() + within_s
    while (left := processes_of(uid)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


# This process's sandbox directories only: other tests (the code preset, the code env's tests) may run
# sandboxes beside this module in another worker, whose directories come and go meanwhile.
OWN_DIRS = f"/tmp/megamarl-sbx-{JUDGE}-*"


def own_cgroups(pid: int = JUDGE) -> list[str]:
    return [
        path
        for hierarchy in sandbox._hierarchies()
        for path in glob.glob(os.path.join(hierarchy.parent, f"megamarl-sbx-{pid}-*"))
    ]


def busy_cgroups(within_s: float = 3.0) -> list[str]:
    """The judge's cgroups that still hold a task after ``within_s`` (idle ones are reused)."""
    end = time.monotonic() + within_s
    while True:
        busy = [path for path in own_cgroups() if Path(f"{path}/cgroup.procs").read_text().strip()]
        if not busy or time.monotonic() > end:
            return busy
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(glob.glob(OWN_DIRS))
    sentinel = subprocess.Popen(["sleep", "120"])  # a root process of the judge's: must survive
    yield sentinel
    try:
        assert sentinel.poll() is None, "an attack killed a process of the judge's"
        assert wait_gone(sandbox_uid()) == [], "sandbox processes outlived the run"
        assert set(glob.glob(OWN_DIRS)) == before
        assert busy_cgroups() == [], "a task outlived its run in the run's cgroup"
    finally:
        sentinel.kill()
        sentinel.wait()


def test_real_solution_scores_full_marks():
    assert judge_calls(REAL, CASES, CONFIG, setup=SETUP).passed == [True, True, True]


def scores_zero(code: str, config: SandboxConfig = CONFIG):
    start = time.monotonic()
    verdict = judge_calls(code, CASES, config, setup=SETUP)
    assert verdict.passed == [False, False, False], verdict.messages
    return verdict, time.monotonic() - start


READ_MEMORY = """
import os, re
found, opened = {}, []
def grab(open_mem):
    try:
        data = open_mem()
    except OSError as exc:
        return
    opened.append(1)
    for a, b in re.findall(rb'scale\\((-?\\d+)\\) == (-?\\d+)', data):
        found[int(a)] = int(b)
def by_path(pid):
    return lambda: open(f'/proc/{pid}/mem', 'rb').read(1 << 20)
def by_dir_fd(pid):
    def read():
        proc = os.open('/proc', os.O_RDONLY | os.O_DIRECTORY)
        fd = os.open(f'{pid}/mem', os.O_RDONLY, dir_fd=proc)
        return os.read(fd, 1 << 20)
    return read
for pid in [JUDGE, os.getppid(), 1] + [p for p in os.listdir('/proc') if p.isdigit()]:
    grab(by_path(pid))
    grab(by_dir_fd(pid))
    try:
        os.listdir(f'/proc/{JUDGE}')
        opened.append('judge dir')
    except OSError:
        pass
print('OPENED', opened)
def scale(x):
    return found.get(x, 0)
""".replace("JUDGE", str(JUDGE))

FORK_EXEC_SETSID = (
    """
import _posixsubprocess, os, sys
exe = os.fsencode(sys.executable)
for _ in range(20):
    r, w = os.pipe()
    try:
        _posixsubprocess.fork_exec([exe, b'-c', b'import time; time.sleep(30)'], [exe], True, (w,), None, None,
                                   -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
    except OSError:
        pass
"""  # noqa: E501 - the embedded program keeps its own layout
    + FALLBACK
)

FORK_SETSID_DOUBLE = (
    """
import os, time
for _ in range(5):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.closerange(0, 64)  # hold nothing the judge waits on
            x = bytearray(100 * 1024 * 1024)
            time.sleep(30)
        os._exit(0)
"""
    + FALLBACK
)

SIGNALS = (
    """
import os, signal
for pid in (JUDGE, SENTINEL, os.getppid(), 1):
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    try:
        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
    except OSError:
        pass
try:
    os.killpg(0, signal.SIGKILL)
except OSError:
    pass
"""
    + FALLBACK
)

PIPE_HOLDER = (
    """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(60)  # keeps stdout, stderr and the channel open
    os._exit(0)
"""
    + FALLBACK
)


def test_reading_judge_memory_finds_nothing():
    verdict, _ = scores_zero(READ_MEMORY)
    # the judge's /proc entry does not exist in the sandbox: nothing was opened by path or dir_fd
    # except the candidate's own memory (its pid is in the listing)
    assert all("judge dir" not in m for m in verdict.messages)


def test_fork_exec_and_setsid_children_die_with_the_run():
    for attack in (FORK_EXEC_SETSID, FORK_SETSID_DOUBLE):
        _, seconds = scores_zero(attack)
        assert seconds < CONFIG.timeout_s  # the run ended when the candidate did, not at the deadline
        assert wait_gone(sandbox_uid()) == []


def test_signals_to_the_judge_do_nothing(nothing_left_behind):
    attack = SIGNALS.replace("JUDGE", str(JUDGE)).replace("SENTINEL", str(nothing_left_behind.pid))
    scores_zero(attack)
    assert nothing_left_behind.poll() is None


def test_detached_child_holding_the_pipes_does_not_hang_the_judge():
    _, seconds = scores_zero(PIPE_HOLDER)
    assert seconds < 2.5
    start = time.monotonic()
    verdict = judge_stdio(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(3)",
        [StdioCase("", "3\n")],
        CONFIG,
    )
    assert verdict.passed == [True] and time.monotonic() - start < 2.5  # the tree died with its parent


def test_writes_outside_the_sandbox_fail(tmp_path):
    target, db = tmp_path / "escape.txt", tmp_path / "escape.sqlite"
    prefix = os.path.realpath(sys.base_prefix)
    attack = (
        f"""
import os, sqlite3
root = os.open('/', os.O_RDONLY | os.O_DIRECTORY)
for path in ({str(target)[1:]!r}, 'python/evil.py', 'usr/evil', 'sandbox/main.py', 'etc/evil'):
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, dir_fd=root))
    except OSError:
        pass
try:
    sqlite3.connect({str(db)!r}).execute('create table t (x)')
except Exception:
    pass
"""
        + FALLBACK
    )
    scores_zero(attack)
    assert sorted(os.listdir(tmp_path)) == [] and not os.path.exists(os.path.join(prefix, "evil.py"))


def test_stdout_flood_keeps_the_judge_small():
    flood = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    chan_flood = (
        "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(100):\n    os.write(__channel__, chunk)\n"
        + FALLBACK
    )
    tracemalloc.start()
    try:
        verdict = judge_stdio(flood, [StdioCase("", "3\n")], CONFIG)
        scores_zero(chan_flood)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict.passed == [False]
    assert peak < 24 * 1024 * 1024, peak  # max_output_mb=4 per stream; was ~300 MB for 100 MB


def test_overflow_and_deep_values_score_zero_and_are_counted():
    huge = judge_calls(
        "def half(x):\n    return 10 ** 400\n", [ExprCase("half(3)", 1.5), ExprCase("half(4)", 2)], CONFIG
    )
    assert huge.passed == [False, False] and huge.num_judge_errors == 1  # float: OverflowError caught
    deep = "def scale(x):\n    v = []\n    for _ in range(100000):\n        v = [v]\n    return v\n"
    verdict, _ = scores_zero(deep)  # json.dumps fails inside the sandbox: an error record
    # 5000 deep is past json's recursion limit and all of it (~35 KB) fits a pipe's 64 KiB buffer: the
    # candidate never waits for the judge to read, so a loaded machine cannot turn it into a timeout
    forged = (
        "import os, json\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n    "
        "try:\n        for i in range(3):\n"
        "            os.write(fd, (json.dumps({'i': i, 'value': '[' * 5000 + ']' * 5000}) + "
        "'\\n').encode())\n"
        "        os.write(fd, b'[' * 5000 + b'\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
    )
    verdict, _ = scores_zero(forged)  # the judge's own json.loads hits RecursionError: counted
    assert verdict.num_judge_errors == 3
    assert judge_calls(
        "def big():\n    return 10 ** 17 + 1\n", [ExprCase("big()", 10**17)], CONFIG
    ).passed == [False]


def test_long_correct_output_scores_full_marks():
    expected = "".join(f"{i} {i * i}\n" for i in range(680))
    assert 6800 < len(expected) < 7000  # the 6.9 KB case (stdout used to be cut at 4000 chars)
    right = "for i in range(680):\n    print(i, i * i)\n"
    wrong = "for i in range(680):\n    print(i, i * i if i < 670 else 0)\n"
    cases = [StdioCase("", expected)]
    assert judge_stdio(right, cases, CONFIG).passed == [True]
    assert judge_stdio(wrong, cases, CONFIG).passed == [False]


def test_stdio_candidate_cannot_read_the_dataset(tmp_path):
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text('{"tests": [{"input": "1 2", "output": "3"}]}\n')
    leak = (
        f"try:\n    print(open({str(dataset)!r}).read())\nexcept OSError as exc:\n    print('denied', exc)\n"
    )
    verdict = judge_stdio(leak, [StdioCase("1 2", "3")], CONFIG)
    assert verdict.passed == [False]


def test_killed_judge_leaves_nothing(tmp_path):
    # a judge process (sandbox.py alone: it imports nothing from megamarl) SIGKILLed mid-run
    script = (
        "import importlib.util, sys\nspec = importlib.util.spec_from_file_location('sbx', "
        f"{sandbox.__file__!r})\n"
        "sbx = sys.modules['sbx'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(sbx)\n"
        "print('started', flush=True)\n"
        "sbx.run_python(sys.argv[2], sbx.SandboxConfig(timeout_s=60), isolated=sys.argv[1] == 'isolated')\n"
    )
    candidate = "import os, time\ntry:\n    os.fork()\nexcept PermissionError:\n    pass\ntime.sleep(60)\n"
    for mode in ("isolated", "unsafe"):
        judge = subprocess.Popen(
            [sys.executable, "-c", script, mode, candidate], stdout=subprocess.PIPE, text=True
        )
        assert judge.stdout.readline() == "started\n"
        uid = sandbox_uid(judge.pid)
        end = time.monotonic() + 10
        while not (
            processes_of(uid) if mode == "isolated" else glob.glob(f"/tmp/megamarl-sbx-{judge.pid}-*")
        ):
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.3)
        with open(f"/proc/{judge.pid}/task/{judge.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        judge.kill()
        judge.wait()
        judge.stdout.close()
        if mode == "isolated":
            assert wait_gone(uid) == []  # --die-with-parent, then the PID namespace goes
            # the next run of any judge removes the dead one's cgroups (in a parallel suite, another
            # worker's sandbox may have done so already)
            sandbox.run_python("pass", CONFIG)
            assert own_cgroups(judge.pid) == []
        else:
            # the old path runs as root in the host /tmp; its candidates outlive a killed judge (one
            # reason it is unsafe): end them here; the next run removes the dead judge's dir
            for child in children:
                try:
                    os.killpg(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert glob.glob(f"/tmp/megamarl-sbx-{judge.pid}-*") != []
            sandbox.run_python("pass", CONFIG, isolated=False)
            assert glob.glob(f"/tmp/megamarl-sbx-{judge.pid}-*") == []


needs_cgroups = pytest.mark.skipif(
    sandbox.tree_limits() == "rlimits",
    reason="no writable cgroup hierarchy here: limits are per process (rlimits)",
)

# three children each hold 150 MB, under the 256 MB RLIMIT_AS of each process but not of the tree
MEMORY_HOG = """
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        x = bytearray(150 << 20)
        time.sleep(5)
        os._exit(0)
    kids.append(pid)
time.sleep(1.5)
print(sum(os.waitpid(kid, os.WNOHANG) == (0, 0) for kid in kids))
"""

# two children spin for 1 s of wall time; the parent reports their CPU time over the wall time
CPU_SPIN = """
import os, time
start = time.monotonic()
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - start < 1.0:
            pass
        os._exit(0)
    kids.append(pid)
for kid in kids:
    os.waitpid(kid, 0)
t = os.times()
print(round((t.children_user + t.children_system) / (time.monotonic() - start), 2))
"""


@needs_cgroups
def test_memory_limit_holds_for_the_tree(monkeypatch):
    holding = sandbox.run_python(MEMORY_HOG, CONFIG)
    assert holding.stdout.strip() in ("", "0", "1"), holding  # 256 MB: one 150 MB child at a time
    monkeypatch.setattr(sandbox, "_hierarchies", lambda: ())  # rlimits alone: every child holds its 150 MB
    assert sandbox.run_python(MEMORY_HOG, CONFIG).stdout.strip() == "3"


@needs_cgroups
def test_a_judge_that_exits_removes_its_cgroups():
    script = (
        "import importlib.util, sys\nspec = importlib.util.spec_from_file_location('sbx', "
        f"{sandbox.__file__!r})\n"
        "sbx = sys.modules['sbx'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(sbx)\n"
        "print(sbx.run_python('print(1)').stdout.strip(), sbx.tree_limits())\nimport os\nprint(os.getpid())\n"
    )
    lines = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    assert lines[0].startswith("1 cgroup")
    assert own_cgroups(int(lines[1])) == []


@needs_cgroups
def test_cpu_bandwidth_holds_for_the_tree():
    share = sandbox.run_python(CPU_SPIN, SandboxConfig(timeout_s=4.0, cpus=0.5))
    assert float(share.stdout) <= 0.5 + 0.1, share  # two spinning children share half a core


# --- judge attacks (issue #44 item 2): comparison, forged asserts, the problem's time budget -------
# Each attack scores 0 through the real judge (or the code env around it) while the reference scores
# full marks; the autouse fixture above checks that the judge stayed alive and nothing was left.

MUL_CASES = parse_assert_tests(
    "assert mul(123456789, 987654321) == 121932631112635269\nassert mul(10 ** 9, 10 ** 9 + 7) == "
    "1000000007000000000\nassert mul(3, 4) == 12\n"
)[1]


@pytest.mark.parametrize(
    "attack",
    [
        "def mul(a, b):\n    return float(a * b)\n",  # within 1e-6 relative of every answer, wrong by 1-99
        "def mul(a, b):\n    return a * b + 1 if a * b > 10 ** 12 else float(a * b)\n",
    ],
)
def test_judge_attack_float_for_an_int_answer(attack):
    assert judge_calls("def mul(a, b):\n    return a * b\n", MUL_CASES, CONFIG).passed == [True] * 3
    assert judge_calls(attack, MUL_CASES, CONFIG).passed == [False] * 3


# asserts with no literal side: before, `bool(<test>)` evaluated in the candidate's namespace and
# compared with a public True
NON_LITERAL = "assert scale(2) > scale(1)\nassert scale(-1) < 0 < scale(1)\nassert scale(1) != scale(0)\n"
BUILTIN_TESTS = (  # builtins the tests call, which the candidate shadows in its own namespace
    "assert isinstance(scale(2), int)\nassert len(str(scale(10))) == 2\n"
    "assert sorted([scale(1), scale(0)]) == [0, 3]\n"
)
FORGE = (
    "import json, os\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n"
    "    for record in RECORDS:\n        try: os.write(fd, (json.dumps(record) + '\\n').encode())\n"
    "        except OSError: pass\nos._exit(0)\n"
)
SHADOWED = "def scale(x):\n    return 'x'\n"
ASSERT_ATTACKS = {
    "shadows bool": ("bool = lambda *a, **k: True\n" + FALLBACK, NON_LITERAL),
    "patches builtins.bool": (
        "import builtins\nbuiltins.bool = lambda *a, **k: True\n" + FALLBACK,
        NON_LITERAL,
    ),
    "shadows the builtins a test calls": (
        "isinstance = lambda *a: True\nlen = lambda *a: 2\nsorted = lambda *a: [0, 3]\n" + SHADOWED,
        BUILTIN_TESTS,
    ),
    "forges the True marker": (
        "RECORDS = [{'i': i, 'value': 'true'} for i in range(3)]\n" + FORGE,
        NON_LITERAL,
    ),
    # operands that satisfy each comparison (literal ones in any form), in the harness's record format
    "forges satisfying operands": (
        "RECORDS = [{'i': 0, 'values': ['2', '1']}, {'i': 1, 'values': ['-1', '0', '1']}, "
        "{'i': 2, 'values': ['1', '0']}]\n" + FORGE,
        NON_LITERAL,
    ),
}


@pytest.mark.parametrize("name", list(ASSERT_ATTACKS))
def test_judge_attack_forged_asserts_on_hidden_tests(name):
    # hidden tests with no literal side: the coder's reward and the team's stay 0
    attack, tests = ASSERT_ATTACKS[name]
    env = EnvMaker("code", sandbox=CONFIG)(Task("c", CodeProblem("Write scale.", REAL, tests)))
    assert env.step("coder", Action("coder", "", REAL, True, 0, 0)).local_reward == 1.0
    coder = env.step("coder", Action("coder", "", attack, True, 0, 0))
    assert (coder.local_reward, env.team_reward()) == (0.0, 0.0), env.feedback


@pytest.mark.parametrize("name", list(ASSERT_ATTACKS))
def test_judge_attack_forged_asserts_on_the_tester_path(name):
    # a wrong coder must not get the episode approved by the tester's (correct) asserts, nor take the
    # correct tester's reward from 1 to 0
    attack, tests = ASSERT_ATTACKS[name]
    env = EnvMaker("code", sandbox=CONFIG)(Task("c", CodeProblem("Write scale.", REAL, HIDDEN_LITERAL)))
    env.step("coder", Action("coder", "", REAL, True, 0, 0))
    right = env.step("tester", Action("tester", "", tests, True, 0, 0))
    assert (right.local_reward, env.done) == (1.0, True)  # the tests hold on the reference and the code
    env = EnvMaker("code", sandbox=CONFIG)(Task("c", CodeProblem("Write scale.", REAL, HIDDEN_LITERAL)))
    assert env.step("coder", Action("coder", "", attack, True, 0, 0)).local_reward == 0.0
    tester = env.step("tester", Action("tester", "", tests, True, 0, 0))
    assert (tester.local_reward, env.done, env.team_reward()) == (1.0, False, 0.0), env.feedback


HIDDEN_LITERAL = "assert scale(2) == 6\nassert scale(-1) == -3\nassert scale(5) == 15\n"
SLEEPY_STDIO = [StdioCase(f"{i} 1\n", f"{i + 1}\n") for i in range(8)]


def test_judge_attack_sleeping_stdio_cases_share_one_budget():
    # 8 sleeping cases took 8 x timeout_s (40.6 s at timeout_s = 5, past env_timeout_s = 30). The
    # problem's budget is the code env's default (problem_budget_s 12): a correct program's 8 sandbox
    # starts fit it on a slow machine (at budget 1.0 s, CI's machine ran out after 6 cases); the
    # sleeper's first case times out at 1 s and ends the problem.
    config = SandboxConfig(timeout_s=1.0, cpu_s=2, memory_mb=256)
    budget_s = CodeConfig().problem_budget_s
    real = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert judge_stdio(real, SLEEPY_STDIO, config, budget_s=budget_s).passed == [True] * 8
    start = time.monotonic()
    verdict = judge_stdio("import time\ntime.sleep(60)\n", SLEEPY_STDIO, config, budget_s=budget_s)
    elapsed = time.monotonic() - start
    assert verdict.passed == [False] * 8 and elapsed < 3.0, (elapsed, verdict.messages)


def test_judge_attack_a_budget_at_the_env_timeout_is_rejected_at_load():
    preset = Path(__file__).resolve().parents[2] / "configs" / "presets" / "code.yaml"
    load_config(preset, [])
    with pytest.raises(ValueError, match=r"rollout.env_timeout_s"):
        load_config(preset, ["rollout.env_timeout_s=10"])


# --- kernel attack surface (issue #44 items 1 and 4): one attack per family -------------------------
# Each candidate reports what every attempt returned ("ok" or the errno's name) as JSON on stdout;
# the test compares the whole report. Syscall numbers come from libseccomp (the filter's own
# library, so the numbers are the ones the filter uses on this architecture).


def syscall_numbers(*names: str) -> dict[str, int]:
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in names}


SYSCALLS = syscall_numbers(
    "add_key", "request_key", "keyctl", "unshare", "clone", "clone3", "setns", "io_uring_setup",
    "userfaultfd", "perf_event_open", "bpf", "ptrace", "process_vm_readv", "pidfd_open", "pidfd_getfd",
    "mount", "fsopen", "chroot", "socketpair",
)  # fmt: skip

# calls a raw syscall by name: "ok" or the errno's name
CALL = f"""
import ctypes, errno, json, os
NR = {SYSCALLS!r}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(NR[name]), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return rc if rc >= 0 else errno.errorcode[ctypes.get_errno()]
def outcome(rc):
    return 'ok' if isinstance(rc, int) else rc
"""


def report(attack: str, config: SandboxConfig = CONFIG) -> dict:
    result = sandbox.run_python(CALL + attack, config)
    assert result.ok, result
    return json.loads(result.stdout)


SESSION_KEYRING = -3  # KEY_SPEC_SESSION_KEYRING
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_READ = 0, 1, 11

# a correct run files each answer in the session keyring; a later run that returns 0 replays them
KEYRING_STORE = (
    CALL
    + """
def scale(x):
    answer = str(x * 3).encode()
    call('add_key', b'user', f'scale:{x}'.encode(), answer, len(answer), -3)
    return x * 3
"""
)
KEYRING_REPLAY = (
    CALL
    + """
def scale(x):
    key = call('request_key', b'user', f'scale:{x}'.encode(), None, 0)
    if isinstance(key, str):
        key = call('keyctl', 10, -3, b'user', f'scale:{x}'.encode(), 0)  # KEYCTL_SEARCH
    if isinstance(key, str):
        return 0
    buffer = ctypes.create_string_buffer(64)
    size = call('keyctl', 11, key, buffer, 64)  # KEYCTL_READ
    return int(buffer.raw[:size]) if isinstance(size, int) else 0
"""
)
KEYRING_CALLS = """
buffer = ctypes.create_string_buffer(64)
print(json.dumps({
    'keyctl get session': outcome(call('keyctl', 0, -3, 0)),
    'keyctl join session': outcome(call('keyctl', 1, b'mine')),
    'keyctl user keyring': outcome(call('keyctl', 0, -4, 1)),
    'add_key': outcome(call('add_key', b'user', b'k', b'v', 1, -3)),
    'request_key': outcome(call('request_key', b'user', b'k', None, 0)),
}))
"""

# A judge with a session keyring of its own (systemd services, pam_keyinit logins and container
# runtimes give their processes one): it joins a new one, judges the storing run, then the replay
# run, and reports what it finds in its keyring afterwards.
KEYRING_JUDGE = f"""
import ctypes, json, sys
from megamarl.orchestration import sandbox
from megamarl.orchestration.judge import judge_calls, parse_assert_tests
from megamarl.orchestration.sandbox import SandboxConfig
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keyctl = lambda *args: libc.syscall(ctypes.c_long({SYSCALLS["keyctl"]}), *map(ctypes.c_long, args))
assert keyctl({KEYCTL_JOIN_SESSION_KEYRING}, 0) > 0, ctypes.get_errno()  # a new anonymous one
session = keyctl({KEYCTL_GET_KEYRING_ID}, {SESSION_KEYRING}, 0)
config = SandboxConfig(timeout_s=4.0, cpu_s=2, memory_mb=256)
setup, cases = parse_assert_tests({HIDDEN_LITERAL!r})
store, replay, probe = sys.argv[1:4]
links = ctypes.create_string_buffer(4096)
print(json.dumps({{
    'session': session > 0,
    'store': judge_calls(store, cases, config, setup=setup).passed,
    'replay': judge_calls(replay, cases, config, setup=setup).passed,
    'calls': json.loads(sandbox.run_python(probe, config).stdout),
    'keys in the judge session': keyctl({KEYCTL_READ}, session, ctypes.addressof(links), 4096) // 4,
    'same session': keyctl({KEYCTL_GET_KEYRING_ID}, {SESSION_KEYRING}, 0) == session,
}}))
"""


def run_judge(script: str, *args: str) -> subprocess.CompletedProcess:
    """Another judge process, importing megamarl from this checkout."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        check=False,
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_keyring_replay_finds_nothing_under_a_judge_with_a_session_keyring():
    judge = run_judge(KEYRING_JUDGE, KEYRING_STORE, KEYRING_REPLAY, CALL + KEYRING_CALLS)
    assert judge.returncode == 0, judge.stderr
    assert json.loads(judge.stdout) == {
        "session": True,
        "store": [True, True, True],  # it is a correct solution: keyctl failing does not break it
        "replay": [False, False, False],
        "calls": {
            "keyctl get session": "EPERM",
            "keyctl join session": "EPERM",
            "keyctl user keyring": "EPERM",
            "add_key": "EPERM",
            "request_key": "EPERM",
        },
        "keys in the judge session": 0,
        "same session": True,
    }


USER_NAMESPACES = """
import subprocess
def capabilities(status):
    return {line.split(':')[0]: line.split()[1] for line in status.splitlines()
            if line.startswith(('Cap', 'NoNewPrivs', 'Seccomp:'))}
child = call('clone', 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
if child == 0:
    os._exit(0)
if isinstance(child, int):
    os.waitpid(child, 0)
tool = subprocess.run(['unshare', '--user', '--map-root-user', 'cat', '/proc/self/status'],
                      capture_output=True, text=True)
print(json.dumps({
    'unshare(CLONE_NEWUSER)': outcome(call('unshare', 0x10000000)),
    'clone(CLONE_NEWUSER)': outcome(child),
    'clone3': outcome(call('clone3', None, 0)),
    'setns': outcome(call('setns', os.open('/proc/self/ns/user', os.O_RDONLY), 0)),
    'unshare --user': [tool.returncode, capabilities(tool.stdout)],
    'own status': capabilities(open('/proc/self/status').read()),
}))
"""

NO_CAPABILITIES = {
    "CapInh": "0000000000000000",
    "CapPrm": "0000000000000000",
    "CapEff": "0000000000000000",
    "CapBnd": "0000000000000000",
    "CapAmb": "0000000000000000",
    "NoNewPrivs": "1",
    "Seccomp": "2",
}


def test_nested_user_namespaces_are_refused():
    assert report(USER_NAMESPACES) == {
        "unshare(CLONE_NEWUSER)": "EPERM",
        "clone(CLONE_NEWUSER)": "EPERM",
        "clone3": "ENOSYS",  # its flags are out of the filter's reach: libc falls back to clone
        "setns": "EPERM",
        "unshare --user": [1, {}],  # the tool fails before it execs cat
        "own status": NO_CAPABILITIES,
    }


SOCKETS = """
import asyncio, socket
def attempt(make):
    try:
        make().close()
        return 'ok'
    except OSError as exc:
        return errno.errorcode[exc.errno]
def loopback():
    with socket.create_connection(('127.0.0.1', PORT), timeout=1):
        return 'ok'
def pair():
    a, b = socket.socketpair()
    a.sendall(b'x')
    return b.recv(1).decode()
print(json.dumps({
    'AF_INET': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    'AF_INET6': attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)),
    'AF_NETLINK': attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)),
    'AF_PACKET': attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)),
    'socketpair(AF_INET)': outcome(call('socketpair', 2, 1, 0, ctypes.create_string_buffer(8))),
    'loopback': attempt(loopback),
    'socketpair(AF_UNIX)': pair(),
    'asyncio.run': asyncio.run(asyncio.sleep(0, 'ran')),
}))
"""


def test_no_socket_family_but_unix_and_loopback_unreachable():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        attack = SOCKETS.replace("PORT", str(listener.getsockname()[1]))
        outcome = report(attack)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the host's loopback saw no connection
    assert outcome == {
        "AF_INET": "EPERM",
        "AF_INET6": "EPERM",
        "AF_NETLINK": "EPERM",
        "AF_PACKET": "EPERM",
        "socketpair(AF_INET)": "EPERM",
        "loopback": "EPERM",  # no AF_INET socket to reach it with
        "socketpair(AF_UNIX)": "x",
        "asyncio.run": "ran",
    }


KERNEL_SURFACE = """
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
attr = ctypes.create_string_buffer(128)  # struct perf_event_attr: a software dummy event on itself
attr[0:4] = (1).to_bytes(4, 'little')  # PERF_TYPE_SOFTWARE
attr[4:8] = (128).to_bytes(4, 'little')  # size
attr[8:16] = (9).to_bytes(8, 'little')  # PERF_COUNT_SW_DUMMY
attr[40:48] = (0b1100000).to_bytes(8, 'little')  # exclude_kernel, exclude_hv
map_attr = ctypes.create_string_buffer((2).to_bytes(4, 'little') + (4).to_bytes(4, 'little') * 2
                                       + (1).to_bytes(4, 'little'), 72)  # BPF_MAP_TYPE_ARRAY
pidfd = call('pidfd_open', os.getpid(), 0)
print(json.dumps({
    'io_uring_setup': outcome(call('io_uring_setup', 1, params)),
    'userfaultfd': outcome(call('userfaultfd', os.O_CLOEXEC | 1)),  # UFFD_USER_MODE_ONLY
    'perf_event_open': outcome(call('perf_event_open', attr, 0, -1, -1, 0)),
    'bpf': outcome(call('bpf', 0, map_attr, 72)),  # BPF_MAP_CREATE
    'ptrace': outcome(call('ptrace', 0, 0, 0, 0)),  # PTRACE_TRACEME
    'process_vm_readv': outcome(call('process_vm_readv', os.getpid(), None, 0, None, 0, 0)),
    'pidfd_getfd': outcome(call('pidfd_getfd', pidfd, 1, 0)),
}))
"""


def test_kernel_attack_surface_is_refused():
    # each call is valid as made: without the filter the kernel would run it (bpf aside, which
    # unprivileged_bpf_disabled may refuse too)
    assert report(KERNEL_SURFACE) == {
        "io_uring_setup": "EPERM",
        "userfaultfd": "EPERM",
        "perf_event_open": "EPERM",
        "bpf": "EPERM",
        "ptrace": "EPERM",
        "process_vm_readv": "EPERM",
        "pidfd_getfd": "EPERM",
    }


MOUNTS = """
import subprocess
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
def mount():
    return 'ok' if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0 else errno.errorcode[ctypes.get_errno()]
# the route around the missing capability: a user namespace of its own, in which it is root
tool = subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'mount', '-t', 'tmpfs', 'none', '/tmp'],
                      capture_output=True, text=True)
print(json.dumps({
    'mount': mount(),
    'fsopen': outcome(call('fsopen', b'tmpfs', 0)),
    'chroot': outcome(call('chroot', b'/tmp')),
    'unshare --user --mount mount': tool.returncode,
}))
"""  # noqa: E501 - the embedded program keeps its own layout


def test_mounts_are_refused():
    assert report(MOUNTS) == {
        "mount": "EPERM",
        "fsopen": "EPERM",
        "chroot": "EPERM",
        "unshare --user --mount mount": 1,
    }


PTYS = """
def attempt(make):
    try:
        make()
        return 'ok'
    except OSError as exc:
        return errno.errorcode[exc.errno]
print(json.dumps({
    '/dev/ptmx': os.path.exists('/dev/ptmx'),
    '/dev/pts': os.listdir('/dev/pts'),
    'openpty': attempt(os.openpty),
    'open /dev/pts/ptmx': attempt(lambda: os.open('/dev/pts/ptmx', os.O_RDWR)),
}))
"""


def test_no_pty_can_be_opened():
    # the host's pty limit (kernel.pty.max) is global: a candidate's masters would count against it
    assert report(PTYS) == {
        "/dev/ptmx": False,
        "/dev/pts": [],
        "openpty": "ENOENT",
        "open /dev/pts/ptmx": "ENOENT",
    }


STDERR_FLOOD = "import sys\nchunk = 'x' * (1 << 20)\nwhile True:\n    sys.stderr.write(chunk)\n"


def test_stderr_flood_ends_the_run_and_keeps_the_judge_small():
    tracemalloc.start()
    try:
        start, cpu = time.monotonic(), time.thread_time()
        flood = sandbox.run_python(STDERR_FLOOD, CONFIG)
        seconds, cpu_s = time.monotonic() - start, time.thread_time() - cpu
        scores_zero(STDERR_FLOOD.replace("while True:", "for _ in range(100):") + FALLBACK)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (flood.status, len(flood.stderr)) == ("output_limit", CONFIG.max_output_chars)
    assert seconds < 2.5, seconds  # not the 4 s deadline: the cap ended it
    assert cpu_s < 0.5, cpu_s  # the judge read ~4 MB, not all the candidate could write
    assert peak < 24 * 1024 * 1024, peak


OOM_SCORE = """
def attempt(value):
    try:
        with open('/proc/self/oom_score_adj', 'w') as f:
            f.write(value)
        return 'ok'
    except OSError as exc:
        return errno.errorcode[exc.errno]
read, write = os.pipe()
if os.fork() == 0:
    os.write(write, open('/proc/self/oom_score_adj', 'rb').read())
    os._exit(0)
os.wait()
print(json.dumps({
    'own': open('/proc/self/oom_score_adj').read().strip(),
    'child': os.read(read, 16).decode().strip(),
    'lower to 0': attempt('0'),
    'lower to -1000': attempt('-1000'),
}))
"""


def test_candidates_are_the_oom_killers_first_choice():
    # EROFS: /proc is read-only; the kernel's own floor (EACCES) needs CAP_SYS_RESOURCE in the judge
    assert report(OOM_SCORE) == {
        "own": "1000",
        "child": "1000",
        "lower to 0": "EROFS",
        "lower to -1000": "EROFS",
    }


# A judge in a PID namespace of its own (as in a container sharing the host's cgroup tree): its
# pid names no process here. It takes a pid that no process here has, starts a run that sleeps and
# prints the run's cgroups once the run's tasks are in them.
HIDDEN_JUDGE = """
import glob, json, os, sys, threading, time
while True:  # /proc is this namespace's parent's: a pid found there is another process's
    child = os.fork()
    if child == 0 and not os.path.exists(f'/proc/{os.getpid()}'):
        break  # the judge
    if child == 0:
        os._exit(3)  # retry with the next pid
    status = os.waitpid(child, 0)[1] >> 8
    if status != 3:
        sys.exit(status)
from megamarl.orchestration import sandbox
config = sandbox.SandboxConfig(timeout_s=60)
assert sandbox.isolation_error() is None  # its probe run is over before the sleeping run starts
threading.Thread(target=sandbox.run_python, args=('import time\\ntime.sleep(60)', config), daemon=True).start()
pattern = [os.path.join(h.parent, f'megamarl-sbx-{os.getpid()}-*') for h in sandbox._hierarchies()]
while True:
    paths = [path for p in pattern for path in glob.glob(p)]
    if paths and all(open(f'{path}/cgroup.procs').read().strip() for path in paths):
        break
    time.sleep(0.05)
print(json.dumps(paths), flush=True)
time.sleep(120)
"""  # noqa: E501 - the embedded program keeps its own layout


def pid_namespace_error() -> str | None:
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "true"], check=False, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.strip()


def holds_tasks(paths: list[str]) -> bool:
    return all(Path(f"{path}/cgroup.procs").read_text().strip() for path in paths)


@needs_cgroups
def test_stale_sweep_spares_a_live_judge_in_another_pid_namespace():
    if (reason := pid_namespace_error()) is not None:
        pytest.skip(f"cannot start a judge in a PID namespace here: {reason}")
    root = Path(__file__).resolve().parents[2]
    judge = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", HIDDEN_JUDGE],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        paths = json.loads(judge.stdout.readline())
        hidden_pid = int(os.path.basename(paths[0]).split("-")[2])
        assert not os.path.exists(f"/proc/{hidden_pid}")  # to this judge, its owner looks dead
        sandbox.run_python("pass", CONFIG)  # this judge's sweep
        assert holds_tasks(paths), "the sweep killed a live judge's run"
    finally:
        judge.kill()  # --kill-child: the namespace's init dies, and every process in it
        judge.wait()
        judge.stdout.close()
    assert wait_gone(sandbox_uid(hidden_pid)) == []
    end = time.monotonic() + 5
    while any(os.path.exists(path) for path in paths):  # its holder died: the next sweep removes them
        assert time.monotonic() < end, [path for path in paths if os.path.exists(path)]
        sandbox.run_python("pass", CONFIG)
        time.sleep(0.1)
