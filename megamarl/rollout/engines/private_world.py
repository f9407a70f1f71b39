"""A private ``torch.distributed`` world for an in-process engine that lives on one rank of a training job.

vLLM's in-process worker creates its groups with ``new_group`` (collective over the default world) and
destroys the default world at shutdown; on a rank of a multi-rank job that hangs and would kill the
trainer's groups. ``PrivateWorld.active()`` swaps c10d's process-group state for a separate one while
the engine initialises or shuts down, then swaps the trainer's back; the engine's groups keep working
outside it, and the private group counter starts far above the trainer's. It touches c10d internals
(checked with torch 2.13), the price of one process for engine and trainer (in-place weight reload).
Details: docs/design-notes.md, "megamarl/rollout/engines/private_world.py".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

# c10d module globals behind ``_World``'s registries (pg_map, pg_names, ...).
_REGISTRIES = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
PRIVATE_GROUP_COUNT_START = 1 << 20  # private group names "1048576", ...: never the trainer's


class PrivateWorld:
    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None  # the private world while it is not active
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: ``torch.distributed`` sees only the private world (empty until someone inits it)."""
        from torch.distributed import distributed_c10d as c10d

        with self._lock:
            ours = _capture(c10d)
            private = self._state if self._state is not None else _fresh(c10d)
            # destroy_process_group() of the private world resets the counter to 0: keep it far off
            private["_group_count"] = max(private["_group_count"], PRIVATE_GROUP_COUNT_START)
            _install(c10d, private)
            try:
                yield
            finally:
                self._state = _capture(c10d)
                _install(c10d, ours)
                _reregister(c10d, ours)


def _fresh(c10d) -> dict[str, Any]:
    state: dict[str, Any] = {name: type(getattr(c10d, name))() for name in _REGISTRIES}
    state["_world"] = c10d._World()
    state["_group_count"] = PRIVATE_GROUP_COUNT_START
    return state


def _capture(c10d) -> dict[str, Any]:
    state = {name: getattr(c10d, name) for name in _REGISTRIES}
    state["_world"] = c10d._world
    state["_group_count"] = c10d._group_count
    return state


def _install(c10d, state: dict[str, Any]) -> None:
    for name, value in state.items():
        setattr(c10d, name, value)
    pg = state["_world"].default_pg
    c10d._update_default_pg(pg)  # also sets the C++ global rank


def _reregister(c10d, state: dict[str, Any]) -> None:
    """A private ``destroy_process_group()`` unregisters *every* group name in c10d's C++ registry."""
    for pg, name in state["_pg_names"].items():
        try:
            c10d._resolve_process_group(name)
        except Exception:  # noqa: BLE001 - not registered (any more)
            c10d._register_process_group(name, pg)
