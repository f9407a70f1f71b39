"""The KL term's reference policy: a frozen copy of the initial weights in the policy's layout and
dtype, without gradients or optimizer state, with its own logit window. ``policies.<p>.ref_offload``
keeps it in host memory and brings it to the device only for its forward pass."""

from __future__ import annotations

import contextlib

import torch

from megamarl.rl.forward import LogitWindow
from megamarl.rl.offload import TrainStateOffload
from megamarl.rl.tree import RotaryPositions


class ReferenceModel:
    def __init__(self, model: torch.nn.Module, device: torch.device | str, *, offload: bool):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.window = LogitWindow(self.model)
        self.rotary = RotaryPositions(self.model)  # prefix_tree: RoPE by node depth
        self.offload = TrainStateOffload(device, [self.model]) if offload else None
        if self.offload is not None:
            self.offload.offload()
        else:
            self.model.to(device)

    @contextlib.contextmanager
    def on_device(self):
        """The model on the device for the duration (a no-op unless offloaded)."""
        if self.offload is None:
            yield
            return
        self.offload.restore()
        try:
            yield
        finally:
            self.offload.offload()
