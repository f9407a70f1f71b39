"""Sandbox: bad code is stopped and reported as a failed run, never harming the test process."""

import time

import pytest

from megamarl.orchestration.sandbox import SandboxConfig, _unshare_prefix, run_python

FAST = SandboxConfig(timeout_s=3.0, cpu_s=1, memory_mb=256)


def test_ok_and_assertion_failure():
    ok = run_python("print(6 * 7)", FAST)
    assert (ok.ok, ok.status, ok.stdout.strip()) == (True, "ok", "42")
    bad = run_python("assert 1 == 2", FAST)
    assert (bad.ok, bad.status) == (False, "error") and "AssertionError" in bad.stderr


def test_network_is_blocked():
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 9))"
    result = run_python(code, FAST)
    assert not result.ok and "PermissionError" in result.stderr


def test_network_namespace_has_no_interfaces_when_available():
    if not _unshare_prefix():
        pytest.skip("unshare -n is not available (needs root)")
    # even with the audit hook out of the picture, the namespace has only a down loopback
    result = run_python("print(open('/proc/net/dev').read())", FAST)
    assert result.ok and "eth0" not in result.stdout


def test_fork_bomb_is_stopped():
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert not result.ok and "os.fork" in result.stderr and time.monotonic() - start < 3
    result = run_python("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])", FAST)
    assert not result.ok and "subprocess.Popen" in result.stderr


def test_infinite_loop_and_sleep_are_stopped():
    spin = run_python("while True:\n    pass", FAST)
    # SIGXCPU at the CPU rlimit; on a loaded machine the wall-clock timeout may fire first
    assert not spin.ok and spin.status in ("killed", "timeout")
    sleepy = run_python("import time\ntime.sleep(60)", SandboxConfig(timeout_s=0.5))
    assert not sleepy.ok and sleepy.status == "timeout"


def test_memory_hog_is_stopped():
    result = run_python("x = bytearray(1024 ** 3)", FAST)
    assert not result.ok and "MemoryError" in result.stderr


def test_write_outside_tmp_is_blocked(tmp_path):
    target = tmp_path / "escape.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
                 f"import os\nos.symlink('/etc', 'link')"):
        result = run_python(code, FAST)
        assert not result.ok and "PermissionError" in result.stderr
    assert not target.exists() and not (tmp_path / "d").exists()
    inside = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", FAST)
    assert inside.ok and inside.stdout.strip() == "ok"
