"""Delta weight pushes (``policies.<p>.engine.delta_sync: tensors``): send only the sync units whose
bytes changed since the version the target replicas hold.

A sending rank keeps, per HF tensor it streamed in the last push, a digest of its bytes *in the
engine's dtype* (a small fp32 change that rounds to the same bf16 value moves nothing), and the
version that push stamped. The next push is a delta only when every target replica holds exactly
that version; otherwise (first push, a restarted replica, one that missed a push, a failed push)
it is full. Digests, not copies: a copy is a second model in memory on the sender. XXH3-128
(``xxhash``), not a cryptographic hash: hashing every tensor is on the push's path, and it is ~10x
faster than BLAKE2b (docs/design-notes.md); weights are not adversarial, and 128 bits make an
accidental collision negligible.

The unit of selection is a *sync unit*: every tensor of one decoder layer (``...layers.<i>.``), or
one module outside the layers (the embedding, the final norm, the LM head). vLLM reloads in place
layer by layer: a fused module (q/k/v, gate/up; MoE experts) is rebuilt from the tensors it
receives, so a partial push of one would load the rest as garbage, while a module that receives
nothing keeps its current tensors. A unit is pushed whole when any of its tensors changed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Sequence

import torch
import xxhash

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def sync_unit(name: str) -> str:
    """The unit an HF tensor is pushed with: its decoder layer's prefix, else its module."""
    match = _LAYER.match(name)
    return match.group(1) if match else name.rpartition(".")[0] or name


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """XXH3-128 of the tensor's dtype, shape and bytes (as they would be sent)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    digest = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(memoryview(flat.numpy()))
    return digest.digest()


def common_version(held: Sequence[int]) -> int | None:
    """The version every target replica holds, or None when they differ (or there are none)."""
    return held[0] if held and all(v == held[0] for v in held) else None


class DeltaSelector:
    """One rank's record of what it last streamed to a policy's replicas, and the filter that streams
    only the changed units of the next push (``select``)."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version the digests describe (None: nothing recorded)
        self.digests: dict[str, bytes] = {}
        self.num_skipped = 0  # tensors the last ``select`` left out
        self.num_selected = 0

    def select(
        self, named: Iterable[tuple[str, torch.Tensor]], *, base: int | None, version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``named`` (HF name, tensor in the engine's dtype), leaving out the units whose bytes
        equal those recorded, when ``base`` (the version the targets hold) is the recorded version;
        everything otherwise. Once the stream is exhausted the digests describe ``version``; a stream
        abandoned midway leaves nothing recorded, so the next push is full."""
        delta = base is not None and base == self.version
        previous, self.version, self.digests = self.digests, None, {}
        self.num_skipped = self.num_selected = 0
        recorded: dict[str, bytes] = {}
        units: set[str] = set()
        for unit, members in itertools.groupby(named, key=lambda item: sync_unit(item[0])):
            if unit in units:
                raise ValueError(
                    f"delta_sync: the export came back to unit {unit!r} after leaving it; a unit's "
                    "tensors must be contiguous"
                )
            units.add(unit)
            group = list(members)  # one layer: the tensors wait until the unit is decided
            for name, tensor in group:
                recorded[name] = tensor_digest(tensor)
            if delta and all(previous.get(n) == recorded[n] for n, _ in group):
                self.num_skipped += len(group)
                continue
            self.num_selected += len(group)
            yield from group
        self.digests, self.version = recorded, version
