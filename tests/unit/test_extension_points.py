"""docs/extension_points.md is generated from the registries and committed: it fails here when stale,
and every config key that names a registry entry is rejected at load when the name is unregistered."""

from __future__ import annotations

from pathlib import Path

from script_loader import load_script  # tests/ helper

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_extension_points.py"


def _generator():
    return load_script(SCRIPT)


def test_committed_page_is_current_and_every_naming_key_is_checked_at_load():
    generator = _generator()
    text = generator.render()
    assert (ROOT / "docs" / "extension_points.md").read_text() == text, (
        "stale: run python scripts/gen_extension_points.py"
    )
    assert "NOT CHECKED" not in text
    registries = generator.registries()
    assert len(registries) >= 13
    # every extension point is named by config keys, except the model family (the checkpoint's model_type)
    assert [r.kind for r in registries if not r.keys] == ["model architecture (HF model_type)"]
    assert all(f"| `{key}` | " in text for registry in registries for key in registry.keys)
