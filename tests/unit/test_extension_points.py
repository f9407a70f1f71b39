"""docs/extension_points.md is generated from the registries and committed: it fails here when stale,
and every config key that names a registry entry is rejected at load when the name is unregistered."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_extension_points.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_extension_points", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_page_is_current_and_every_naming_key_is_checked_at_load():
    generator = _generator()
    text = generator.render()
    assert (ROOT / "docs" / "extension_points.md").read_text() == text, \
        "stale: run python scripts/gen_extension_points.py"
    assert "NOT CHECKED" not in text
    registries = generator.registries()
    assert len(registries) >= 13
    # every extension point is named by config keys, except the model family (the checkpoint's model_type)
    assert [r.kind for r in registries if not r.keys] == ["model architecture (HF model_type)"]
    assert all(f"| `{key}` | " in text for registry in registries for key in registry.keys)
