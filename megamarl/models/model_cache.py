"""Build a model directory once, safely, however many ranks or processes ask for it at the same time.

``build_once(target, build)`` returns at once when ``target`` holds a complete entry (a manifest,
``.megamarl-complete``, written last, whose listed files exist with their sizes); otherwise it takes
an exclusive ``filelock`` next to the target, re-checks, removes a partial entry (logged), builds into
a temporary directory on the same filesystem and renames it into place. Invariant: a reader never sees
a half-written directory, and one process builds while the others wait and reuse it. The lock
serialises the processes of one node; across nodes on a shared filesystem ``filelock`` falls back to
its soft lock. Details: docs/design-notes.md, "megamarl/models/model_cache.py".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

MANIFEST = ".megamarl-complete"


def save_hf_model(model, directory: str | os.PathLike) -> None:
    """Write an HF causal LM as ``save_pretrained`` would (config, generation config, one safetensors
    file without the tied LM head) from *any* rank. transformers 5's ``save_pretrained`` writes the
    weights and config only on global rank 0 when torch.distributed is initialised, but a cache
    entry is built by whichever rank took the lock (seen: rank 1 built an entry with no config.json)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if not getattr(model.config, "architectures", None):  # save_pretrained records them; SGLang needs them
        model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embed is not None and head.data_ptr() == embed.data_ptr():
        del state["lm_head.weight"]  # tied: the embedding is stored once, as transformers does
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )


def is_complete(target: Path) -> bool:
    """True when ``target`` has a manifest and every file it lists has its recorded size."""
    manifest = target / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all(
        (target / name).is_file() and (target / name).stat().st_size == size for name, size in files.items()
    )


def write_manifest(directory: Path) -> None:
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def build_once(
    target: str | os.PathLike,
    build: Callable[[Path], None],
    *,
    what: str = "model",
    status: Callable[[str], None] | None = None,
) -> Path:
    """Make ``target`` a complete directory, calling ``build(tmp_dir)`` at most once across processes.

    ``build`` writes the entry's files into the empty directory it is given. ``status`` receives one
    line before a build starts and one when it ends (default: stderr).
    """
    target = Path(target)
    if is_complete(target):
        return target
    say = status or (lambda line: print(f"[megamarl] {line}", file=sys.stderr, flush=True))
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if is_complete(target):  # another process built it while we waited for the lock
            return target
        if target.exists():
            say(f"{what}: {target} is partial or corrupt (no complete manifest); rebuilding it")
            shutil.rmtree(target)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            say(f"{what}: preparing {target} (once; other ranks wait for it)")
            build(tmp)
            write_manifest(tmp)
            tmp.replace(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"{what}: ready at {target}")
    return target


@contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Write a directory that appears whole or not at all: yields an empty sibling temporary
    directory; on success its manifest is written and it replaces ``target`` (an earlier ``target``
    is removed first), on failure it is removed and ``target`` is left as it was. Used for converted
    and exported checkpoints, which a reader (vLLM, transformers) may open as soon as they exist."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
