"""Name -> implementation registries for every extension point (estimators, engines, agents, envs...).

One small class instead of ad-hoc dicts: registering twice is an error (two plugins silently
shadowing each other is the bug this prevents), an unknown name lists the registered ones, and
plugin modules are imported eagerly so that a plugin that fails to import raises instead of being
silently missing from the registry.

Traits: what the loop must know about a variant (an estimator's group key, whether an engine can
sleep) is declared where the variant is registered, as a frozen dataclass of the registry's
``traits`` type (``@REGISTRY.register("name", traits=Traits(...))``); an entry registered without
traits gets the type's defaults, which are the conservative answers. Callers ask
``REGISTRY.traits(name)``, never keep their own set of names.

Signature: each registry states the call signature of its entries in ``signature``;
tests/unit/test_registry_contracts.py checks every entry of every registry against it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations of one extension point, each with its traits."""

    def __init__(self, kind: str, *, traits: type | None = None, signature: str = ""):
        self.kind = kind
        self.traits_type = traits  # None: this extension point declares no traits
        self.signature = signature  # the documented call signature of an entry
        self._items: dict[str, T] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, *, traits: Any = None) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name", traits=...)``."""

        def decorator(obj: T) -> T:
            self.add(name, obj, traits=traits)
            return obj

        return decorator

    def add(self, name: str, obj: T, *, traits: Any = None) -> None:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} '{name}' is already registered ({self._items[name]!r})")
        if traits is None and self.traits_type is not None:
            traits = self.traits_type()
        if self.traits_type is None and traits is not None:
            raise ValueError(f"{self.kind} '{name}': this registry declares no traits")
        if self.traits_type is not None and not isinstance(traits, self.traits_type):
            raise TypeError(f"{self.kind} '{name}': traits must be {self.traits_type.__name__}, got {traits!r}")
        self._items[name] = obj
        self._traits[name] = traits

    def traits(self, name: str, *, key: str | None = None) -> Any:
        """The traits ``name`` was registered with (the type's defaults when it gave none)."""
        self.get(name, key=key)
        return self._traits[name]

    def get(self, name: str, *, key: str | None = None) -> T:
        """Look up ``name``; ``key`` is the config key the name came from, used in the error."""
        if name not in self._items:
            where = f"{key}=" if key else ""
            raise ValueError(
                f"unknown {self.kind} {where}'{name}'; registered: {sorted(self._items) or 'none'}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def import_plugins(modules: Iterable[str], *, paths: Iterable[str] = ()) -> None:
    """Import user plugin modules (they register on import). A failing import is re-raised with
    the module named: a plugin that does not load must stop the run, not vanish from a registry.

    ``paths`` (``plugin_paths``, absolute) go to the front of ``sys.path`` and the working
    directory to its end: under ``torchrun scripts/train.py`` ``sys.path[0]`` is ``scripts/``, not
    the directory the user launched from, so a plugin next to the user's config was not found."""
    modules, paths = list(modules), [str(p) for p in paths]
    if modules:
        for path in reversed(paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module.split(".")[0]:  # the plugin was found; something it imports was not
                raise ImportError(f"plugin module '{module}' failed to import: {exc!r}") from exc
            raise ImportError(
                f"plugins: module '{module}' not found on plugin_paths {list(paths)} or in the working "
                f"directory {os.getcwd()}; set plugin_paths (relative to the config file's directory)"
            ) from exc
        except Exception as exc:  # re-raised with context
            raise ImportError(f"plugins: module '{module}' failed to import: {exc!r}") from exc


def resolve_callable(spec: str, *, key: str) -> Callable:
    """``"module:function"`` -> the function (a user hook named in config, e.g. ``env.kwargs.render``
    or ``rollout.policy_mapping``). Errors name ``key``; a module that fails to import is an error."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{key} must be 'module:function', got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}={spec!r}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"{key}={spec!r} is not callable")  # noqa: TRY004 - a config error: ValueError naming the key
    return obj
