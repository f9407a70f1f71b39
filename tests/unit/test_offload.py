"""``megamarl.rl.offload`` on a CPU worker group: the training state already lives in host memory,
so ``offload_train_state`` moves nothing (the GPU path: tests/gpu/test_offload_gpu.py); forced on, its
host buffers are made once (pinned on CUDA machines) and reused by every later offload."""

import torch
from torch.overrides import TorchFunctionMode

from megamarl.rl.offload import TrainStateOffload


def test_cpu_state_stays_where_it_is():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ids = [p.data_ptr() for p in model.parameters()] + [
        v.data_ptr() for s in optimizer.state.values() for v in s.values()
    ]
    state = TrainStateOffload(torch.device("cpu"), [model], [optimizer])
    assert not state.applies
    assert state.offload().num_bytes == 0 and not state.offloaded
    assert state.restore().num_bytes == 0
    assert ids == [p.data_ptr() for p in model.parameters()] + [
        v.data_ptr() for s in optimizer.state.values() for v in s.values()
    ]


class _FactoryCount(TorchFunctionMode):
    """Counts ``torch.empty`` calls (how the offload makes its host buffers)."""

    def __init__(self):
        super().__init__()
        self.empty = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.empty += func is torch.empty
        return func(*args, **(kwargs or {}))


def test_host_buffers_are_made_once_and_reused_by_every_later_offload(monkeypatch):
    """The mechanism forced on for a CPU "device" (as tests/distributed/test_offload_mechanism.py does):
    the first offload makes one host buffer per storage; the second makes none, lands in the same
    buffers, and the state still comes back exactly."""
    monkeypatch.setattr(TrainStateOffload, "applies", property(lambda self: True))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = TrainStateOffload(torch.device("cpu"), [model], [optimizer])
    expected = [t.clone() for t in _state_tensors(model, optimizer)]
    made, hosts = [], []
    for _ in range(2):
        with _FactoryCount() as count:
            moved = state.offload().num_bytes
        made.append(count.empty)
        hosts.append([host.data_ptr() for _, host, _ in state._held])
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert state.restore().num_bytes == moved > 0
        assert all(torch.equal(a, b) for a, b in zip(expected, _state_tensors(model, optimizer), strict=True))
    num_storages = len(hosts[0])
    assert made == [num_storages, 0] and num_storages >= 4, made  # weight, bias and their two Adam moments
    assert hosts[1] == hosts[0]


def _state_tensors(model, optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
    return [*model.parameters(), *moments]
