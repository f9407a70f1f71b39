"""``megamarl.rl.offload`` on a CPU worker group: the training state already lives in host memory,
so ``offload_train_state`` moves nothing (the GPU path: tests/gpu/test_offload_gpu.py)."""

import torch

from megamarl.rl.offload import TrainStateOffload


def test_cpu_state_stays_where_it_is():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ids = [p.data_ptr() for p in model.parameters()] + [v.data_ptr() for s in optimizer.state.values() for v in s.values()]
    state = TrainStateOffload(torch.device("cpu"), [model], [optimizer])
    assert not state.applies
    assert state.offload().num_bytes == 0 and not state.offloaded
    assert state.restore().num_bytes == 0
    assert ids == [p.data_ptr() for p in model.parameters()] + [v.data_ptr() for s in optimizer.state.values() for v in s.values()]
