"""Training state out of accelerator memory while the engines on the same devices generate
(``policies.<p>.offload_train_state``, colocated sync mode; the dry-run plans memory this way).

``offload`` copies the storage of every parameter and buffer (model, reference, value head), of the
optimizers' main parameters and of their state to pinned host buffers (allocated once, reused) and
resizes each storage to zero bytes; DDP's gradient buffers are freed without a copy. ``restore``
resizes back and copies in. Invariant: storage by storage, never ``param.data = ...``, so the views
megatron-core's DDP makes of ``param_data`` and every Python reference stay valid (as megatron-core's
own ``offload_to_cpu``; verl and NeMo-RL do the same). On a CPU worker group both calls do nothing and
say so in their return value. Why storages, and the tests: docs/design-notes.md, "megamarl/rl/offload.py".
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megamarl.parallel.hardware import synchronize

HOST = torch.device("cpu")


@dataclass
class OffloadStats:
    num_bytes: int = 0  # moved to (or back from) host memory
    seconds: float = 0.0


@dataclass
class TrainStateOffload:
    device: torch.device
    modules: list[torch.nn.Module]  # the DDP-wrapped model first; reference model, value head
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    offloaded: bool = False
    # each offloaded storage with its host copy and size, in the order they left
    _held: list[tuple[torch.UntypedStorage, torch.UntypedStorage, int]] = field(
        default_factory=list, repr=False
    )
    # the host buffers, kept across offloads: the i-th storage to leave lands in the i-th buffer
    _hosts: list[torch.UntypedStorage] = field(default_factory=list, repr=False)

    @property
    def applies(self) -> bool:
        """Only an accelerator's memory is worth freeing."""
        return self.device.type != "cpu"

    def offload(self) -> OffloadStats:
        if not self.applies or self.offloaded:
            return OffloadStats()
        start = time.perf_counter()
        for module in self.modules:
            if hasattr(module, "offload_grad_buffers"):  # megatron-core DDP: frees the grad buffers
                module.offload_grad_buffers(synchronize=True, empty_cache=False)
        pin = torch.cuda.is_available()
        for index, storage in enumerate(_unique_storages(self._tensors(), self.device)):
            size = storage.nbytes()
            if index == len(self._hosts):
                self._hosts.append(host_buffer(size, pin=pin))
            elif self._hosts[index].nbytes() != size:  # the state changed shape (e.g. a new optimizer state)
                self._hosts[index] = host_buffer(size, pin=pin)
            host = self._hosts[index]
            host.copy_(storage, non_blocking=host.is_pinned())
            self._held.append((storage, host, size))
        synchronize()  # every copy has landed before the device memory is released
        for storage, _, _ in self._held:
            storage.resize_(0)
        _empty_cache()
        self.offloaded = True
        return OffloadStats(sum(size for *_, size in self._held), time.perf_counter() - start)

    def restore(self) -> OffloadStats:
        if not self.offloaded:
            return OffloadStats()
        start = time.perf_counter()
        for storage, host, size in self._held:
            storage.resize_(size)
            storage.copy_(host, non_blocking=host.is_pinned())
        for module in self.modules:
            if hasattr(module, "restore_grad_buffers"):
                module.restore_grad_buffers(synchronize=False)
        synchronize()
        moved = sum(size for *_, size in self._held)
        self._held = []
        self.offloaded = False
        return OffloadStats(moved, time.perf_counter() - start)

    def _tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor of the training state (views of one buffer included; storages are deduplicated)."""
        for module in self.modules:
            # nn.Module's methods: megatron-core's DDP shadows ``buffers`` with its list of grad buffers
            yield from torch.nn.Module.parameters(module)
            yield from torch.nn.Module.buffers(module)
        for optimizer in torch_optimizers(self.optimizers):
            yield from main_params(optimizer)
            for state in optimizer.state.values():
                yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def offload_train_states(workers: dict, names: list[str]) -> dict[str, float]:
    """Offload these policies' train states; the metrics: GiB moved and seconds, per policy."""
    metrics = {}
    for name in names:
        stats = workers[name].train_state.offload()
        metrics[f"perf/offloaded_gib/{name}"] = stats.num_bytes / 2**30
        metrics[f"timing_s/{name}/offload"] = stats.seconds
    return metrics


def restore_train_states(workers: dict, names: list[str]) -> dict[str, float]:
    """Restore these policies' train states; the metrics: seconds, per policy."""
    return {f"timing_s/{name}/restore": workers[name].train_state.restore().seconds for name in names}


def host_buffer(num_bytes: int, *, pin: bool) -> torch.UntypedStorage:
    """A host storage for ``num_bytes`` of device state (pinned on CUDA machines: asynchronous copies)."""
    return torch.empty(num_bytes, dtype=torch.uint8, device=HOST, pin_memory=pin).untyped_storage()


def torch_optimizers(optimizers) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's (``ChainedOptimizer`` -> each ``.optimizer``)."""
    out = []
    for optimizer in optimizers:
        if hasattr(optimizer, "chained_optimizers"):
            out.extend(torch_optimizers(optimizer.chained_optimizers))
        elif not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
            out.append(optimizer.optimizer)
        else:
            out.append(optimizer)
    return out


def main_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer steps: megatron-core's fp32 main parameters (or, for an fp32
    model, the model parameters themselves or views of them: their storages count once)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages of ``tensors`` on ``device``, each once however many views share
    it (elsewhere: e.g. the optimizer's ``step`` counters, which live in host memory)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        where = storage.device
        if (
            storage.nbytes()
            and where.type == device.type
            and (device.index is None or where.index == device.index)
        ):
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
