"""Load a script (or any file outside the package) as a module by its path, for tests of the functions
in ``scripts/*.py``: ``load_script("scripts/compare_runs.py")``."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(
    path: str | Path, *, name: str | None = None, before_exec: Callable[[ModuleType], None] | None = None
) -> ModuleType:
    """The module at ``path`` (relative to the repository root, or absolute), executed once. ``name``
    defaults to the file's stem; ``before_exec`` sees the module before its code runs (a script whose
    dataclasses look their module up in ``sys.modules`` is registered there by the caller)."""
    path = Path(path) if Path(path).is_absolute() else ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if before_exec is not None:
        before_exec(module)
    spec.loader.exec_module(module)
    return module
