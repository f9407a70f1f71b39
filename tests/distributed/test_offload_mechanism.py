"""``TrainStateOffload``'s mechanism on a CPU rank, forced on (on a CPU worker group it is off: the
state already lives in host memory; the GPU tier checks it on a GPU, tests/gpu/test_offload_gpu.py).

A worker takes an update, offloads its training state, restores it and takes another; a twin that never
offloaded takes the same updates. Offloaded, every storage of the state is empty (the parameters,
views of megatron-core's DDP ``param_data`` buffer under the distributed optimizer, included);
restored, the views still share the buffer (so the optimizer's updates reach the parameters) and the
twins' weights stay bit-identical. bf16 with the distributed optimizer, fp32 without it."""

import pytest
import torch
from test_policy_update import _batch, _loss_cfg

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

CASES = [(torch.bfloat16, True), (torch.float32, False)]


def _worker(model_dir, wg, dtype, distributed):
    from megamarl.config import PolicyConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    policy = PolicyConfig(model=model_dir, micro_batch_size=2, lr=1e-2, distributed_optimizer=distributed)
    return PolicyWorker("p", policy, wg, load_policy_model(policy, wg, seed=0, dtype=dtype), _loss_cfg())


def _body(rank, model_dir):
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.offload import TrainStateOffload

    TrainStateOffload.applies = property(lambda self: True)  # this child only: the CPU is the "device"
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    out = {}
    for dtype, distributed in CASES:
        plain, offloading = (_worker(model_dir, wg, dtype, distributed) for _ in range(2))
        plain.train_step(_batch())
        offloading.train_step(_batch())
        params = list(offloading.model.parameters())
        buffers = [b.param_data for b in offloading.model.buffers if b.param_data is not None]
        stats = offloading.train_state.offload()
        state = [
            v for s in offloading.optimizer.chained_optimizers[0].optimizer.state.values() for v in s.values()
        ]
        empty = {
            "params": all(p.untyped_storage().nbytes() == 0 for p in params),
            "adam": all(v.untyped_storage().nbytes() == 0 for v in state),
            "ddp_param_data": all(b.untyped_storage().nbytes() == 0 for b in buffers),
        }
        restored = offloading.train_state.restore()
        buffer_storages = {b.untyped_storage().data_ptr() for b in buffers}
        views = all(p.untyped_storage().data_ptr() in buffer_storages for p in params) if buffers else None
        plain.train_step(_batch())
        offloading.train_step(_batch())
        a, b = ({n: t.clone() for n, t in w.export()} for w in (plain, offloading))
        out[(str(dtype), distributed)] = {
            "moved": stats.num_bytes,
            "restored": restored.num_bytes,
            "empty": empty,
            "views": views,
            "num_buffers": len(buffers),
            "same": all(torch.equal(a[n], b[n]) for n in a),
            "numel": {
                str(t): sum(p.numel() for p in params if p.dtype == t)
                for t in (torch.bfloat16, torch.float32)
            },
        }
    return out


def test_offload_empties_every_storage_and_restores_the_exact_state(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_body, 1, str(model_dir), timeout_s=600)
    for (dtype, distributed), got in r.items():
        assert got["empty"] == {"params": True, "adam": True, "ddp_param_data": True}, (dtype, got)
        assert got["same"], (dtype, distributed)
        assert got["moved"] == got["restored"] > 0, got
        if distributed:  # parameters stay views of the DDP buffer the optimizer writes into
            # one buffer per parameter dtype: bf16 matrices, fp32 norms (the local spec builds them in fp32)
            assert got["num_buffers"] == 2 and got["views"], got
        else:
            assert got["num_buffers"] == 0, got
        # bf16 weights: 2 bytes + fp32 main parameters and two fp32 Adam moments; fp32 ones (the norms;
        # all of them without bf16): 4 bytes + two moments, stepped in place; DDP pads its buffers
        numel = got["numel"]
        assert got["moved"] >= 14 * numel[str(torch.bfloat16)] + 12 * numel[str(torch.float32)], got
