"""Checkers for the device model (issue 15): every tensor a worker group's schedule touches lives on
the WG's device. Used by ``tests/unit/test_device_model.py`` (CPU) and ``tests/gpu`` (CUDA).

``DeviceRecorder`` (a ``TorchDispatchMode``) records the device of every tensor argument and result
of every aten op, forward and backward, so a tensor left on the CPU while the model is on a GPU is
named by the op that met it. On a CPU machine every device is the CPU, so that alone proves nothing
there; ``FactoryAudit`` (a ``TorchFunctionMode``) catches what would go wrong on a GPU: a tensor
created in megamarl code by a factory (``torch.zeros``, ``torch.arange``...) without an explicit
``device=``, which lands on the CPU whatever the WG's device.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import megamarl

PACKAGE = str(Path(megamarl.__file__).parent)
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
    torch.linspace,
}


class DeviceRecorder(TorchDispatchMode):
    """Counts ``(op, device)`` over every tensor an aten op reads or returns; ``off(device)`` lists
    the ops that met a tensor elsewhere. 0-d CPU tensors next to device tensors are legal in PyTorch
    (scalars), but they are recorded too: the WG should not make them."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor):
                self.seen[(str(func), str(leaf.device))] += 1
        return out

    def devices(self) -> set[str]:
        return {device for _, device in self.seen}

    def off(self, device: torch.device | str) -> list[str]:
        want = str(torch.device(device))
        return sorted({f"{op} on {dev}" for op, dev in self.seen if dev != want})


class FactoryAudit(TorchFunctionMode):
    """Records ``file:line function`` of every factory call made from megamarl code without ``device=``."""

    def __init__(self):
        super().__init__()
        self.calls: set[str] = set()
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            self.total += 1
            if "device" not in kwargs:
                where = _megamarl_caller()
                if where:
                    self.calls.add(f"{where} {func.__name__}")
        return func(*args, **kwargs)


def _megamarl_caller() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return f"{Path(name).relative_to(Path(PACKAGE).parent)}:{frame.f_lineno}"
        if "/torch/" not in name and name != __file__:
            return None  # created by a library (megatron-core...) or the test itself
        frame = frame.f_back
    return None
