"""Write docs/extension_points.md: every extension point of megamarl, generated from its registries.

    python scripts/gen_extension_points.py           # rewrite docs/extension_points.md
    python scripts/gen_extension_points.py --check   # exit 1 when the committed file is stale

Read off ``megamarl.registry.Registry.instances`` (every registry megamarl's modules declare): its
name, where it is declared, the signature an entry must have, its traits (a frozen dataclass: field,
default), the entries registered today with the traits each declares, and the config keys that name
an entry. For each key the page shows what ``load_config`` answers when ``configs/signalling_tiny.yaml``
names an unregistered entry there: the load-time check that guards the extension point (it runs here,
so a key that stops being checked shows up as ``NOT CHECKED`` and fails tests/unit/test_extension_points.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "extension_points.md"
BASE = ROOT / "configs" / "signalling_tiny.yaml"
NAMES = {"policies.<name>": "policies.shared", "agents.<name>": "agents.sender"}  # BASE's policy and agent
UNKNOWN = "__unregistered__"
HEADER = """# Extension points

Generated from the registries (`megamarl.registry.Registry.instances`) by
`python scripts/gen_extension_points.py`; `tests/unit/test_extension_points.py` fails when this page
is stale. An extension registers under a name (`@REGISTRY.register("name", traits=...)`), in megamarl
or in a plugin module listed under `plugins:` (docs/plugins.md); `tests/unit/test_registry_contracts.py`
checks every entry against its registry's signature. "Rejected at load" is what `load_config` says
when `configs/signalling_tiny.yaml` names an unregistered entry under that key (run while generating),
before any model loads.
"""


def registries() -> list:
    import megamarl.cli.configure  # imports every module that declares a registry
    import megamarl.models.families  # noqa: F401 - the model families' registry
    from megamarl.registry import Registry

    return sorted((r for r in Registry.instances if r.module.startswith("megamarl.")), key=lambda r: r.kind)


def _variable(registry) -> str:
    module = sys.modules[registry.module]
    return next(name for name, value in vars(module).items() if value is registry)


def _source(module_name: str) -> str:
    return str(Path(sys.modules[module_name].__file__).relative_to(ROOT))


def _traits(value) -> str:
    """The fields an entry's traits set away from the type's defaults."""
    if value is None:
        return ""
    default = type(value)()
    changed = [
        f"{f.name}={getattr(value, f.name)!r}"
        for f in dataclasses.fields(value)
        if getattr(value, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed) or "defaults"


def rejection(key: str) -> str:
    """What load_config says when ``key`` names an unregistered entry (``NOT CHECKED`` when it loads)."""
    from megamarl.cli.configure import load_config

    concrete = key
    for placeholder, name in NAMES.items():
        concrete = concrete.replace(placeholder, name)
    if "<name>" in concrete:  # a map with no entry in BASE (eval.sets.<name>): give it one
        concrete = concrete.replace("<name>", "probe")
    value = f"[{UNKNOWN}]" if key.endswith(".tools") else UNKNOWN
    try:
        load_config(BASE, [f"+{concrete}={value}" if ".sets." in concrete else f"{concrete}={value}"])
    except ValueError as exc:
        return str(exc).splitlines()[0].replace(concrete, key).split("; registered")[0]
    return "NOT CHECKED"


def render() -> str:
    out = [HEADER]
    for registry in registries():
        variable = _variable(registry)
        out.append(f"## {registry.kind}\n")
        out.append(f"`{variable}` in `{_source(registry.module)}`\n")
        out.append(f"- signature: `{registry.signature}`")
        if registry.traits_type is not None:
            fields = ", ".join(
                f"`{f.name}` = `{f.default!r}`" for f in dataclasses.fields(registry.traits_type)
            )
            out.append(f"- traits: `{registry.traits_type.__name__}` ({fields})")
        if registry.keys:
            out.append("- named by: " + ", ".join(f"`{k}`" for k in registry.keys))
        else:
            doc = (sys.modules[registry.module].__doc__ or "").strip().splitlines()
            out.append(f"- named by no config key: {doc[0] if doc else ''}")
        out.append("")
        if registry.keys:
            out.append("| key | rejected at load |")
            out.append("|---|---|")
            out.extend(f"| `{key}` | {rejection(key)} |" for key in registry.keys)
            out.append("")
        entries = [(n, registry.get(n)) for n in registry.names()]
        entries = [(n, obj) for n, obj in entries if _defined_in(obj).startswith("megamarl.")]
        traits = registry.traits_type is not None
        out.append("| entry | defined in |" + (" traits |" if traits else ""))
        out.append("|---|---|" + ("---|" if traits else ""))
        for name, obj in entries:
            row = f"| `{name}` | `{_source(_defined_in(obj))}` |"
            out.append(row + (f" {_traits(registry.traits(name))} |" if traits else ""))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _defined_in(obj) -> str:
    """The module an entry comes from (a module entry: itself); built-ins only, not test helpers."""
    return obj.__name__ if isinstance(obj, type(sys)) else getattr(obj, "__module__", "") or ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed page is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/gen_extension_points.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
