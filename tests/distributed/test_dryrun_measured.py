"""The dry-run's per-rank bytes equal what a real worker allocates (CPU ranks, gloo).

Six policies of one config, each a tiny model on the same 4 ranks, built by the trainer's own
``build_workers`` (``load_policy_model`` + ``PolicyWorker``: megatron-core model, DDP buffers,
optimizer, reference model) and stepped once (so Adam state exists). On every rank the test
counts the bytes of the unique storages of the model parameters, the DDP ``param_data`` /
``grad_data`` buffers, the optimizer's main parameters and state and the reference model, and
compares them, kind by kind, with the dry-run's figure for that rank's pipeline stage
(``dry_run(cfg).worker_groups[p].stages[pp]``, CPU ranks). Layouts: TP2 x DP2, PP2 x DP2 and
TP2 x PP2; with and without the distributed optimizer; with and without a reference model; bf16
and fp32; LoRA; tied (Llama) and untied (Qwen3, QK-norm, a vocabulary that TP pads).
"""

from __future__ import annotations

import gc
import io
from functools import partial

import pytest
import torch
import yaml
from saved_storage import record_saved_storage  # tests/ helper

from megamarl.parallel.hardware import policy_dtype
from megamarl.parallel.launch import run_ranks
from megamarl.parallel.placement import placement_of

pytestmark = pytest.mark.distributed

WORLD = 4
KINDS = ("weights", "grads", "main_params", "optimizer", "reference", "lora")
TOLERANCE = 0.05

# name -> (model, policies.<name> keys); every policy on ranks 0-3
POLICIES = {
    "tp2_dist_ref": ("llama", {"tp": 2, "dtype": "bf16", "distributed_optimizer": True, "kl_coef": 0.1}),
    "tp2_qwen3": ("qwen3", {"tp": 2, "dtype": "bf16", "distributed_optimizer": False}),
    "pp2_dist": ("llama", {"pp": 2, "dtype": "bf16", "distributed_optimizer": True}),
    "pp2_fp32_ref": ("llama", {"pp": 2, "dtype": "fp32", "distributed_optimizer": False, "kl_coef": 0.1}),
    "tp2pp2_dist_ref": (
        "llama",
        {"tp": 2, "pp": 2, "dtype": "bf16", "distributed_optimizer": True, "kl_coef": 0.1},
    ),
    "tp2_lora": (
        "llama",
        {
            "tp": 2,
            "dtype": "bf16",
            "distributed_optimizer": True,
            "kl_coef": 0.1,
            "lora": {"rank": 4, "targets": ["qkv", "proj", "fc1", "fc2"]},
        },
    ),
}


def _write_config(tmp_path) -> str:
    from megamarl.models.packaged import save_tiny_model

    models = {
        "llama": save_tiny_model(tmp_path / "llama", "llama", seed=0),  # tied embeddings
        # untied, QK-norm; 49155 rows: padded to 49156 at TP=2
        "qwen3": save_tiny_model(tmp_path / "qwen3", "qwen3", seed=0, vocab_size=49155),
    }
    common = {
        "ranks": list(range(WORLD)),
        "micro_batch_size": 2,
        "seq_len": 16,
        "lr": 1e-3,
        "engine": {"backend": "hf"},
    }
    policies = {
        name: {"model": str(models[family]), **common, **keys} for name, (family, keys) in POLICIES.items()
    }
    # the LoRA policy's agents, one adapter each (the batch's agent names)
    agents = {"solver": {"policy": "tp2_lora", "lora": "s"}, "verifier": {"policy": "tp2_lora", "lora": "v"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"name": "dryrun_measured", "policies": policies, "agents": agents}))
    return str(path)


def _batch():
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (7, 2), (4, 5)]):
        samples.append(
            Sample(
                task_id=f"t{i % 2}",
                episode_id=f"e{i}",
                agent="solver" if i % 2 else "verifier",
                policy="p",
                turn=0,
                prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
                response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
            )
        )
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.25, -1.5]))


def allocated_bytes(worker) -> dict[str, int]:
    """Bytes of the unique storages a worker holds, by kind (each storage counted once, under the
    first kind that reaches it: a parameter that is a view of DDP's ``param_data`` is a weight)."""
    from megamarl.rl.offload import main_params, torch_optimizers

    seen: dict[int, str] = {}
    out = dict.fromkeys(KINDS, 0)

    def add(kind, tensors):
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = kind
                out[kind] += storage.nbytes()

    named = list(worker.model.module.named_parameters())
    add("weights", [p for n, p in named if ".lora_adapters." not in n])
    add("lora", [p for n, p in named if ".lora_adapters." in n])
    buffers = worker.model.buffers
    add("lora" if worker.adapters else "weights", [b.param_data for b in buffers if b.param_data is not None])
    add("grads", [b.grad_data for b in buffers])
    optimizers = torch_optimizers([worker.optimizer])
    add("main_params", [p for opt in optimizers for p in main_params(opt)])
    add(
        "optimizer",
        [
            v
            for opt in optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ],
    )
    if worker.ref is not None:
        add("reference", list(worker.ref.model.parameters()))
    return out


def _measure_body(rank, config_path):
    from megamarl.cli.configure import load_config
    from megamarl.parallel.hardware import DTYPES
    from megamarl.parallel.placement import build_worker_groups
    from megamarl.rl.policy_setup import build_workers

    cfg = load_config(config_path)
    wgs = build_worker_groups(placement_of(cfg, WORLD))
    results = {}
    for name, policy in cfg.policies.items():
        workers = build_workers(
            {name: policy},
            cfg.agents,
            {name: cfg.algorithm},
            {name: wgs[name]},
            seed=0,
            dtypes={name: DTYPES[policy_dtype(cfg, name)]},
        )
        worker = workers.pop(name)
        metrics = worker.train_step(_batch())
        base = sum(p.numel() for n, p in worker.model.module.named_parameters() if ".lora_adapters." not in n)
        adapters = sum(p.numel() for n, p in worker.model.module.named_parameters() if ".lora_adapters." in n)
        results[name] = {
            "pp": wgs[name].pp_rank,
            "bytes": allocated_bytes(worker),
            "num_base": base,
            "num_adapters": adapters,
            "skipped": metrics.get("nonfinite_skipped", 0.0),
            "optimizer_state": sum(len(o.state) for o in _torch_optimizers(worker)),
        }
        del worker, workers
        gc.collect()
    return results


def _torch_optimizers(worker):
    from megamarl.rl.offload import torch_optimizers

    return torch_optimizers([worker.optimizer])


def test_dry_run_bytes_equal_what_the_worker_allocates(tmp_path):
    from rich.console import Console

    from megamarl.cli.configure import load_config
    from megamarl.driver.schedules import overlaps_training
    from megamarl.planning.dryrun import dry_run
    from megamarl.planning.memory import rank_parameters

    config_path = _write_config(tmp_path)
    cfg = load_config(config_path)
    # before any process group: the dry-run builds a fake world of its own
    report = dry_run(
        cfg,
        overlaps_training=overlaps_training(cfg.trainer),
        console=Console(file=io.StringIO(), width=250),
        world_size=WORLD,
    )
    measured = run_ranks(_measure_body, WORLD, config_path, timeout_s=900)
    rows = []
    for rank, per_policy in enumerate(measured):
        for name, got in per_policy.items():
            wg = report.worker_groups[name]
            planned = wg.stages[got["pp"]]
            assert got["skipped"] == 0 and got["optimizer_state"] > 0, (rank, name, got)  # one real Adam step
            # the per-rank parameter count is exact
            lay = wg.layout
            params = rank_parameters(
                wg.shape,
                tp=lay.tp,
                pp=lay.pp,
                stage=got["pp"],
                lora=cfg.policies[name].lora,
                num_adapters=wg.setup.num_adapters,
            )
            assert (got["num_base"], got["num_adapters"]) == (params.num_base, sum(params.adapters)), (
                rank,
                name,
            )
            for kind in KINDS:
                plan, real = getattr(planned, kind), got["bytes"][kind]
                rows.append((rank, name, kind, plan, real))
                assert abs(plan - real) <= TOLERANCE * max(real, 1), (rank, name, kind, plan, real)
            total_plan = sum(getattr(planned, k) for k in KINDS)
            total_real = sum(got["bytes"].values())
            rows.append((rank, name, "total", total_plan, total_real))
            assert abs(total_plan - total_real) <= TOLERANCE * total_real, (
                rank,
                name,
                total_plan,
                total_real,
            )
    print("\nrank policy kind planned measured ratio")
    for rank, name, kind, plan, real in rows:
        print(rank, name, kind, int(plan), real, f"{plan / real:.4f}" if real else "-")


# ---- activations: what autograd keeps for backward, local spec (CPU), per recompute mode ---------

# (recompute, dtype, pack): packed, the micro-batch is one row of ROWS * SEQ_LEN tokens
ACTIVATION_CASES = [
    (recompute, dtype, False) for recompute in ("none", "selective", "full") for dtype in ("bf16", "fp32")
]
ACTIVATION_CASES += [("none", "bf16", True), ("selective", "bf16", True)]
ROWS, SEQ_LEN = 2, 48


def _activations_body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.hardware import DTYPES
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.forward import causal_mask
    from megamarl.rl.packing import pack
    from megamarl.rl.policy_setup import load_policy_model

    wg = build_worker_groups(PlacementConfig({"tp2": WorkerGroupLayout(ranks=[0, 1], tp=2)}))["tp2"]
    tokens = torch.randint(0, 49152, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    padded = (tokens, torch.arange(SEQ_LEN).expand_as(tokens), causal_mask(SEQ_LEN))
    packed = pack(
        tokens, torch.ones_like(tokens, dtype=torch.bool)
    )  # as rl.forward.packed_forward (local spec)
    packed = (packed.tokens, packed.position_ids, packed.causal_mask())
    saved = {}
    for recompute, dtype, packing in ACTIVATION_CASES:
        policy = PolicyConfig(model=model_dir, recompute=recompute)
        model = load_policy_model(policy, wg, seed=0, dtype=DTYPES[dtype]).model  # the worker's own builder
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(
            partial(record_saved_storage, params, storages), lambda tensor: tensor
        ):
            logits = model(*(packed if packing else padded))
        logits.float().sum().backward()  # the saved tensors were usable
        saved[(recompute, dtype, packing)] = sum(storages.values())
    return saved


def test_saved_activations_match_the_local_spec_formula(tmp_path):
    """One micro-batch through a TP=2 stage (the whole model): the bytes autograd keeps for
    backward equal ``saved_activation_bytes`` for recompute none / selective / full, padded rows
    and one packed row (block-diagonal mask)."""
    from megamarl.config import PolicyConfig
    from megamarl.models.packaged import save_tiny_model
    from megamarl.parallel.placement import WorkerGroupLayout
    from megamarl.planning.memory import TrainingSetup, saved_activation_bytes
    from megamarl.planning.model_presets import resolve_model_shape

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama", seed=0))
    measured = run_ranks(_activations_body, 2, model_dir, timeout_s=600)
    shape, layout = resolve_model_shape(model_dir), WorkerGroupLayout(ranks=[0, 1], tp=2)
    print("\nrecompute dtype pack planned measured ratio")
    for recompute, dtype, packing in ACTIVATION_CASES:
        policy = PolicyConfig(
            model=model_dir, recompute=recompute, seq_len=SEQ_LEN, micro_batch_size=ROWS, pack=packing
        )
        setup = TrainingSetup(dtype=dtype, micro_batch_size=ROWS, spec="local")
        planned = saved_activation_bytes(shape, policy, layout, setup, stage=0)
        for rank in range(2):
            real = measured[rank][(recompute, dtype, packing)]
            print(recompute, dtype, packing, int(planned), real, f"{planned / real:.4f}")
            assert abs(planned - real) <= TOLERANCE * real, (recompute, dtype, packing, rank, planned, real)
