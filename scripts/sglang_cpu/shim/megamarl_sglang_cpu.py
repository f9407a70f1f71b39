"""Lets PyPI's ``torchvision`` import against a CPU-only torch (loaded at start-up by
``megamarl_sglang_cpu.pth``; costs nothing until ``torchvision`` is imported).

PyPI's torchvision wheels link their ``_C`` extension against CUDA torch; on the local CPU build of
torch it does not load, which torchvision tolerates, except that ``torchvision._meta_registrations``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally and fails
with "operator torchvision::nms does not exist". SGLang imports torchvision for its (pure-Python)
image transforms. Before torchvision's own code runs, this defines the two operator schemas (no
kernels: calling them raises), so the import succeeds and everything that does not need the
compiled ops works.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries: list = []  # a torch.library.Library's definitions live as long as the object


def define_missing_ops() -> None:
    import torch

    missing = [s for s in _SCHEMAS if not hasattr(torch.ops.torchvision, s.split("(", 1)[0])]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in missing:
            lib.define(schema)
        _libraries.append(lib)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        define_missing_ops()
        self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
