"""``model_cache.build_once``: one process builds a model directory, concurrent ones wait and read the
finished entry; a partial or corrupt entry is detected and rebuilt (the README quickstart's first run
crashed when both ranks converted the packaged model into an empty cache at once)."""

import io
import json
import multiprocessing as mp
import time
from pathlib import Path

from megamarl.models.model_cache import MANIFEST, build_once, is_complete


def _slow_build(tmp: Path, log: str) -> None:
    with open(log, "a") as f:
        f.write("build\n")
    (tmp / "config.json").write_text('{"model_type": "llama"}')
    time.sleep(1.0)  # a reader arriving now must not see a half-written directory
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)


def _worker(target: str, log: str, out) -> None:
    path = build_once(target, lambda tmp: _slow_build(tmp, log), status=lambda line: None)
    out.put(
        (
            json.loads((path / "config.json").read_text())["model_type"],
            (path / "model.safetensors").stat().st_size,
        )
    )


def test_concurrent_processes_build_once_and_all_read_the_complete_entry(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "builds.log"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(target), str(log), out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [("llama", 1000)] * 3
    assert log.read_text() == "build\n"  # exactly one process built it
    assert is_complete(target)
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".m.tmp")]  # no leftovers


def test_partial_or_corrupt_entries_are_rebuilt(tmp_path):
    target, log = tmp_path / "m", tmp_path / "builds.log"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a crash mid-copy: no manifest
    lines = []
    build_once(target, lambda tmp: _slow_build(tmp, str(log)), status=lines.append)
    assert is_complete(target) and log.read_text() == "build\n"
    assert any("partial or corrupt" in line for line in lines)

    (target / "model.safetensors").write_bytes(b"x" * 10)  # truncated after the manifest was written
    assert not is_complete(target)
    build_once(target, lambda tmp: _slow_build(tmp, str(log)), status=lines.append)
    assert (target / "model.safetensors").stat().st_size == 1000 and log.read_text() == "build\nbuild\n"

    build_once(target, lambda tmp: _slow_build(tmp, str(log)), status=lines.append)  # complete: no build
    assert log.read_text() == "build\nbuild\n"
    assert json.loads((target / MANIFEST).read_text())["files"]["model.safetensors"] == 1000


def test_atomic_dir_replaces_on_success_and_keeps_the_old_entry_on_failure(tmp_path):
    from megamarl.models.model_cache import atomic_dir

    target = tmp_path / "export"
    with atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"v1")
        assert not target.exists()  # nothing visible while it is written
    assert (target / "model.safetensors").read_bytes() == b"v1" and is_complete(target)
    try:
        with atomic_dir(target) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise OSError(28, "No space left on device")
    except OSError:
        pass
    assert (target / "model.safetensors").read_bytes() == b"v1" and is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left behind


def test_progress_bars_are_dropped_off_a_terminal_only(capsys):
    """The GGUF conversion's tqdm bars (carriage-return redraws) stay out of log files: what is written
    to stderr inside the context is dropped when stderr is not a terminal (pytest's capture here)."""
    import sys

    from megamarl.models.packaged import progress_bars_off_a_terminal

    class _Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with progress_bars_off_a_terminal():
        print("Converting and de-quantizing GGUF tensors...:  10%|#", file=sys.stderr)
    assert capsys.readouterr().err == ""
    terminal = _Terminal()
    with progress_bars_off_a_terminal(terminal):
        print("drawn", file=sys.stderr)
    assert capsys.readouterr().err == "drawn\n"  # on a terminal the bars stay
