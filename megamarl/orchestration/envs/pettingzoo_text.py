"""Text <-> PettingZoo spaces: the default ``render`` and ``parse`` hooks of the PettingZoo adapter.

An LLM sees text and answers text; a PettingZoo game speaks gymnasium spaces. These pure functions
bridge the two when a game names no hooks of its own (``env.kwargs.render`` / ``env.kwargs.parse``):

* ``render_observation(obs)``: strings pass through; numpy arrays print as nested lists (no dtype
  noise); a dict observation prints one ``key: value`` line per entry, except that an
  ``action_mask`` entry becomes ``Legal actions: 0, 3, 5`` (what a model can act on) and the
  conventional ``observation`` entry is printed without its key.
* ``parse_action(text, space)``: ``Discrete`` takes the LAST integer of the reply (models write
  "I play 4" or "3 + 1 = 4"); ``MultiDiscrete`` and ``Box`` the last ``size`` numbers in order;
  ``Text`` the stripped reply. The value must lie in the space, else ``InvalidAction``.
* ``action_mask(obs, info)``: the PettingZoo convention (``obs["action_mask"]`` or
  ``info["action_mask"]``); ``is_legal`` checks a ``Discrete`` action against it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?")


class InvalidAction(ValueError):
    """The reply names no action of the space (unparsable or out of the space)."""


def render_observation(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Mapping):
        lines = []
        for key, value in obs.items():
            if key == "action_mask":
                legal = np.flatnonzero(np.asarray(value)).tolist()
                lines.append(f"Legal actions: {', '.join(map(str, legal)) or 'none'}")
            elif key == "observation":
                lines.insert(0, render_observation(value))
            else:
                lines.append(f"{key}: {render_observation(value)}")
        return "\n".join(lines)
    if isinstance(obs, np.ndarray):
        return str(obs.tolist())
    if isinstance(obs, np.generic):
        return str(obs.item())
    return str(obs)


def parse_action(text: str, space: Any) -> Any:
    """The action ``text`` names in ``space`` (a gymnasium space); raises ``InvalidAction``."""
    kind = type(space).__name__
    if kind == "Discrete":
        found = _INT.findall(text)
        if not found:
            raise InvalidAction("no integer in the reply")
        value = np.int64(found[-1])
    elif kind == "MultiDiscrete":
        value = _last_numbers(_INT, text, space).astype(space.dtype)
    elif kind == "Box":
        value = _last_numbers(_NUMBER, text, space).astype(space.dtype)
    elif kind == "Text":
        value = text.strip()
    else:
        raise InvalidAction(f"no default parser for {kind} action spaces; set env.kwargs.parse")
    if not space.contains(value):
        raise InvalidAction(f"{value!r} is not in {space}")
    return int(value) if kind == "Discrete" else value


def _last_numbers(pattern: re.Pattern, text: str, space: Any) -> np.ndarray:
    size = int(np.prod(space.shape))
    found = pattern.findall(text)
    if len(found) < size:
        raise InvalidAction(f"the reply has {len(found)} numbers, the space needs {size}")
    return np.array([float(x) for x in found[-size:]]).reshape(space.shape)


def action_mask(obs: Any, info: Mapping | None = None) -> np.ndarray | None:
    """The legal-action mask of a PettingZoo observation/info, or None when the game has none."""
    for source in (obs, info):
        if isinstance(source, Mapping) and "action_mask" in source:
            return np.asarray(source["action_mask"])
    return None


def is_legal(action: Any, space: Any, mask: np.ndarray | None) -> bool:
    """Masks index ``Discrete`` actions from ``space.start``; other spaces are legal when in the space."""
    if mask is None or type(space).__name__ != "Discrete":
        return True
    return bool(mask[int(action) - int(space.start)])


def random_legal(space: Any, mask: np.ndarray | None, seed: int) -> Any:
    """A uniformly random legal action, reproducible from ``seed``."""
    if type(space).__name__ == "Discrete":
        legal = np.flatnonzero(mask) if mask is not None else np.arange(space.n)
        if not len(legal):
            raise InvalidAction("the action mask allows no action")
        return int(space.start) + int(np.random.default_rng(seed).choice(legal))
    space.seed(seed)
    return space.sample()
