"""Training state out of accelerator memory while the engines on the same devices generate
(``policies.<p>.offload_train_state``, colocated sync mode; the dry-run plans memory this way).

What moves: every parameter of the model and of the reference model, the value head, and every
tensor of the optimizers' state go to pinned host memory; megatron-core's DDP gradient buffers are
freed (``DistributedDataParallel.offload_grad_buffers``: their storage is released, every
``param.main_grad`` view stays valid and is zeroed when ``restore_grad_buffers`` reallocates it).
``restore`` brings the same tensors back; the Python objects (parameters, optimizer state dicts)
stay the same, so nothing that holds a reference to them notices. Same idea as verl's and
NeMo-RL's offload of Megatron workers between rollout and update.

On a CPU worker group the state already lives in host memory: both calls do nothing (and say so in
their return value), so a CPU run honours the key trivially.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

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

    @property
    def applies(self) -> bool:
        """Only an accelerator's memory is worth freeing."""
        return self.device.type != "cpu"

    def offload(self) -> OffloadStats:
        if not self.applies or self.offloaded:
            return OffloadStats()
        start = time.perf_counter()
        moved = 0
        for module in self.modules:
            if hasattr(module, "offload_grad_buffers"):  # megatron-core DDP: frees the grad buffers
                module.offload_grad_buffers(synchronize=True, empty_cache=False)
            for param in _tensors_of(module):
                moved += _move(param, HOST)
        for optimizer in torch_optimizers(self.optimizers):
            for param in main_params(optimizer):
                moved += _move(param, HOST)
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device != HOST:
                        state[key] = _to(value, HOST)
                        moved += value.numel() * value.element_size()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True
        return OffloadStats(moved, time.perf_counter() - start)

    def restore(self) -> OffloadStats:
        if not self.offloaded:
            return OffloadStats()
        start = time.perf_counter()
        moved = 0
        for module in self.modules:
            for param in _tensors_of(module):
                moved += _move(param, self.device)
            if hasattr(module, "restore_grad_buffers"):
                module.restore_grad_buffers(synchronize=False)
        for optimizer in torch_optimizers(self.optimizers):
            for param in main_params(optimizer):
                moved += _move(param, self.device)
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device == HOST and key != "step":
                        state[key] = value.to(self.device, non_blocking=True)
                        moved += value.numel() * value.element_size()
        torch.cuda.synchronize()
        self.offloaded = False
        return OffloadStats(moved, time.perf_counter() - start)


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
    model, the model parameters themselves, which ``_move`` then finds already moved)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _tensors_of(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device == HOST:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor.to(device, non_blocking=True)


def _move(tensor: torch.Tensor, device: torch.device) -> int:
    """Re-home ``tensor``'s data in place (same Parameter object). Returns the bytes moved."""
    if tensor.device == device:
        return 0
    tensor.data = _to(tensor.data, device)
    return tensor.numel() * tensor.element_size()
