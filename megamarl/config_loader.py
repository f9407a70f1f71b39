"""YAML + command-line overrides -> a validated structured config, through Hydra's compose API.

``compose_config(schema_cls, path, overrides)`` is ``load_config``'s engine (``megamarl.config``): the
whole Hydra grammar without ``@hydra.main``, so Hydra never changes the working directory, creates
``outputs/`` or configures logging, and ``torchrun scripts/train.py --config FILE overrides...``
behaves the same on every rank. The primary config's defaults are ``megamarl/defaults`` (the schema's
defaults as untyped YAML), the user's file (free to compose groups) and ``_self_``; the overrides
(``key=value``, ``+``, ``++``, ``~key``, ``group@pkg=option``) apply to that untyped tree, which is then
merged onto the typed schema (``megamarl/schema``) and instantiated, running every ``__post_init__``.
Invariants: ``~key`` means "back to the schema default"; maps (``policies``, ``agents``, ``*.kwargs``)
stay open; a typo in a fixed section or a wrong type is rejected naming the full key. Sweeps
(``a=1,2,3``, ``range``, ``choice``) are expanded by ``expand_sweeps``, one combination per launch.
Why two steps and not the typed schema first: docs/design-notes.md, "megamarl/config_loader.py".
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import types
import typing
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

GROUP = "megamarl"
SCHEMA = "schema"  # the typed dataclass: validation
DEFAULTS = "defaults"  # its defaults as untyped YAML with open maps: composition
_ENTRY = "megamarl_entry"  # the per-load primary config
_CONFIG_SUFFIXES = (".yaml", ".yml")
_ABSENT = object()  # OmegaConf.select's default: the key is not in the composed tree
_registered: dict[str, type] = {}  # group -> the schema class whose nodes the ConfigStore holds


def register_schema(schema_cls: type) -> None:
    """Put the typed schema and its untyped defaults into Hydra's ConfigStore (idempotent). Done once
    per schema class: building the two nodes was ~40% of a load's CPU time (tests load hundreds)."""
    store = ConfigStore.instance()
    stored = store.repo.get(GROUP, {})
    if _registered.get(GROUP) is schema_cls and f"{SCHEMA}.yaml" in stored and f"{DEFAULTS}.yaml" in stored:
        return
    _registered[GROUP] = schema_cls
    store.store(group=GROUP, name=SCHEMA, node=schema_cls)
    typed = OmegaConf.structured(schema_cls)
    defaults = OmegaConf.create(OmegaConf.to_container(typed))
    _open_maps(typed, cast(DictConfig, defaults))  # created from a dataclass's container: a mapping
    store.store(group=GROUP, name=DEFAULTS, node=defaults, package="_global_")


def _open_maps(typed: DictConfig, plain: DictConfig) -> None:
    """Keys may be added to free-form maps (``dict[str, X]`` fields); dataclass sections stay closed."""
    for key in typed:
        child = typed._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            if OmegaConf.get_type(child) is dict:
                OmegaConf.set_struct(plain[key], False)
            else:
                _open_maps(child, plain[key])


def compose_config(
    schema_cls: type,
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    rewrite=None,
    explain=None,
    retired: typing.Mapping[str, str] | None = None,
) -> Any:
    """Compose ``path`` (any YAML file; None: schema defaults) with ``overrides`` and instantiate
    ``schema_cls``. ``rewrite(cfg, config_dir)`` may edit the composed DictConfig before the typed
    merge (``load_config`` resolves ``plugin_paths`` against the file's directory there).
    ``explain(message, merged)`` may reword a component's own ValueError (``load_config`` puts the
    policy's or agent's name into its messages). ``retired``: keys that no longer exist -> what replaced
    them, said instead of "unknown key". Raises ValueError naming the offending key."""
    retired = retired or {}
    overrides = list(overrides)
    _reject_sweeps(overrides)
    register_schema(schema_cls)
    config_dir, entry = _primary(path)
    ConfigStore.instance().store(name=_ENTRY, node={"defaults": [{GROUP: DEFAULTS}, *entry, "_self_"]})
    try:
        GlobalHydra.instance().clear()  # a previous load in this process (tests load many configs)
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="megamarl"):
            composed = compose(config_name=_ENTRY, overrides=overrides)
        for old_key, replaced_by in retired.items():
            if OmegaConf.select(composed, old_key, default=_ABSENT) is not _ABSENT:
                raise ValueError(f"config key '{old_key}': {replaced_by}")
        if rewrite is not None:
            rewrite(composed, config_dir if path is not None else Path.cwd())
        schema = ConfigStore.instance().load(f"{GROUP}/{SCHEMA}.yaml").node
        try:
            merged = OmegaConf.merge(schema, composed)
        except OmegaConfBaseException as exc:
            key = None if getattr(exc, "full_key", None) else _mismatched_key(schema, composed)
            if key is None:
                raise
            raise ValueError(f"config key '{key}': {first_line(exc)}") from exc
        try:
            return OmegaConf.to_object(merged)
        except ValueError as exc:  # a component's __post_init__ (OmegaConf's own errors: below)
            if explain is None or isinstance(exc, OmegaConfBaseException):
                raise
            raise ValueError(explain(str(exc).strip().splitlines()[0], merged)) from exc
    except (HydraException, OmegaConfBaseException) as exc:
        raise ValueError(_describe(exc, schema_cls, retired)) from exc
    finally:
        GlobalHydra.instance().clear()


def _primary(path: str | Path | None) -> tuple[Path, list[str]]:
    if path is None:
        return Path.cwd().resolve(), []
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: file not found")
    if path.suffix != ".yaml":
        raise ValueError(f"--config {path}: Hydra reads configs named *.yaml; rename the file")
    return path.resolve().parent, [path.stem]


# ---- sweeps ---------------------------------------------------------------------------------------


def expand_sweeps(overrides: list[str] | tuple[str, ...]) -> list[list[str]]:
    """Hydra sweep overrides -> one override list per combination (cartesian product, in order).
    ``["a=1,2", "b=x"]`` -> ``[["a=1", "b=x"], ["a=2", "b=x"]]``; no sweep: ``[overrides]``."""
    parsed = _parse(overrides)
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            prefix = override.get_key_element()
            choices.append([f"{prefix}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def _reject_sweeps(overrides: list[str]) -> None:
    sweeps = [o.input_line for o in _parse(overrides) if o.is_sweep_override()]
    if sweeps:
        raise ValueError(
            f"config override {sweeps[0]} is a sweep: a run has one value per key; launch one run per "
            "value (e.g. a Slurm array), or plan all of them with --dry-run (which expands sweeps). "
            "For a list value write key=[a,b]; for a string with commas quote it: key='a,b'"
        )


def _parse(overrides) -> list:
    parser = OverridesParser.create()
    parsed = []
    for override in overrides:  # one at a time, so the error names the bad one
        try:
            parsed.extend(parser.parse_overrides([override]))
        except HydraException as exc:
            raise ValueError(f"config override {override!r}: {first_line(exc)}") from exc
    return parsed


# ---- errors ---------------------------------------------------------------------------------------


def _mismatched_key(schema, composed, prefix: str = "") -> str | None:
    """The first key where the composed config puts a mapping in a list's place or a list in a
    mapping's (OmegaConf's merge error then names no key). Entries of typed maps (``policies.<p>``)
    are checked against their element type."""
    if not isinstance(composed, DictConfig) or not isinstance(schema, DictConfig):
        return None
    element = getattr(schema._metadata, "element_type", None)
    for key in composed:
        theirs = composed._get_node(key)
        if key in schema:
            ours = schema._get_node(key)
        elif dataclasses.is_dataclass(element):
            ours = OmegaConf.structured(element)
        else:
            continue
        path = f"{prefix}{key}"  # type: ignore[str-bytes-safe]  # a config's keys are str
        if isinstance(theirs, (ListConfig, DictConfig)) and _is_list_node(ours) != isinstance(
            theirs, ListConfig
        ):
            return path
        found = _mismatched_key(ours, theirs, path + ".")
        if found:
            return found
    return None


def _is_list_node(node) -> bool:
    """A list-typed schema node, also when its value is None (``Optional[list[int]] = None``)."""
    if isinstance(node, ListConfig):
        return True
    ref = getattr(node._metadata, "ref_type", None)
    args = [a for a in typing.get_args(ref) if a is not type(None)] if _is_union(ref) else [ref]
    return any(typing.get_origin(a) is list for a in args)


def _is_union(hint) -> bool:
    """``Optional[X]`` / ``Union[...]`` and ``X | None`` (``types.UnionType``) alike."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _describe(exc: BaseException, schema_cls: type, retired: typing.Mapping[str, str]) -> str:
    """The deepest OmegaConf error in the chain carries the full key; Hydra's own errors (an unknown
    group option, a missing defaults entry) name the group or the override in their message."""
    cause: BaseException | None
    found, cause = None, exc
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            found = cause
        cause = cause.__cause__
    if found is None:
        message = first_line(exc)
        quoted = re.search(r"An item is already at '([^']+)'", message)
        if quoted:  # '+key=v' on a key that exists
            key = quoted.group(1)
            return f"config key '{key}': already set; replace it with {key}=... (or ++{key}=...: set or add)"
        return f"config: {message}"
    key = found.full_key
    assert key is not None  # found only where full_key is set (above)
    message = first_line(found)
    if ("not in struct" in message or "not in '" in message) and key in retired:
        message = retired[key]
    elif "not in struct" in message or "not in '" in message:
        message = f"unknown key{_suggest(schema_cls, key)}"
    return f"config key '{key}': {message}"


def _suggest(schema_cls: type, full_key: str) -> str:
    """'; did you mean trainer.total_steps?' when the key's parent is a schema section."""
    *parents, leaf = full_key.split(".")
    hint: Any = schema_cls  # a dataclass, a dict[...] alias or, off the schema, None
    for part in parents:
        if dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        elif typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]  # a map entry: the value type
        else:
            return ""
        optional = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = optional[0] if _is_union(hint) and len(optional) == 1 else hint
    if not dataclasses.is_dataclass(hint):
        return ""
    names = [f.name for f in dataclasses.fields(hint)]
    close = difflib.get_close_matches(leaf, names, n=1)
    prefix = ".".join(parents) + "." if parents else ""
    return f"; did you mean {prefix}{close[0]}?" if close else f"; allowed: {names}"


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
