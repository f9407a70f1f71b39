"""docs/config_reference.md is generated from the schema and committed: it fails here when stale, and
every key the schema has (as OmegaConf sees it, independently of the generator) is in it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf
from script_loader import load_script  # tests/ helper

from megamarl.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"


def _generator():
    return load_script(SCRIPT)


def _leaf_keys(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        typed_map = OmegaConf.is_dict(value) and dataclasses.is_dataclass(value._metadata.element_type)
        if OmegaConf.is_dict(value) and (OmegaConf.get_type(value) is not dict or typed_map):
            yield from _leaf_keys(value, f"{path}.")
        else:
            yield path


def test_committed_reference_is_current():
    committed = (ROOT / "docs" / "config_reference.md").read_text()
    assert committed == _generator().render(), "stale: run python scripts/gen_config_reference.py"


def test_every_schema_key_is_documented():
    # one entry per map, every optional section set
    entries = {"policies": {"<name>": {"model": "m", "lora": {}}}, "agents": {"<name>": {"policy": "<name>"}}}
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), entries)
    text = (ROOT / "docs" / "config_reference.md").read_text()
    keys = list(_leaf_keys(cfg))
    assert len(keys) > 90
    assert [k for k in keys if f"| `{k}` |" not in text] == []
    assert "|  |" not in text, "a key without a description: comment it in the schema or in the generator"
