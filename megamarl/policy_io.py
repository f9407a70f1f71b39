"""Glue between a policy's config and its Megatron shard: build + load HF weights, save/resume.

Checkpoints here are per-rank ``torch.save`` files of the DDP-wrapped model and its optimizer, so a
run resumes on the same layout. Layout-changing checkpoints (save at TP=2, load at TP=1) are
megatron-core ``dist_checkpointing``, in ``megamarl.models`` (see ``docs/models.md``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megamarl.config import PolicyConfig
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.worker import ModelHandle


def load_policy_model(policy: PolicyConfig, wg: WorkerGroup, *, seed: int) -> ModelHandle:
    from megamarl.models.bridge import build_model, load_hf_config, load_hf_weights
    from megamarl.models.packaged import resolve_model_path

    path = resolve_model_path(policy.model, key="policies.<p>.model")
    hf_config = load_hf_config(path)
    model = build_model(hf_config, wg, seed=seed, init_weights=False)
    load_hf_weights(model, path, wg)
    return ModelHandle(model=model, vocab_size=hf_config.vocab_size)


def _rank_file(path: Path) -> Path:
    return path / f"rank_{dist.get_rank():05d}.pt"


def save_checkpoint(path: Path, worker) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": worker.model.state_dict(),
        "optimizer": worker.optimizer.state_dict(),
        "num_updates": worker.num_updates,
        "layout": (worker.wg.layout.tp, worker.wg.layout.pp, worker.wg.layout.dp),
    }
    tmp = _rank_file(path).with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(_rank_file(path))


def load_checkpoint(path: Path, worker) -> None:
    state = torch.load(_rank_file(path), weights_only=False)
    layout = (worker.wg.layout.tp, worker.wg.layout.pp, worker.wg.layout.dp)
    if tuple(state["layout"]) != layout:
        raise ValueError(
            f"checkpoint {path} was saved with (tp, pp, dp)={tuple(state['layout'])}, this run has {layout}; "
            "convert it with megamarl.models.convert or resume with the same layout"
        )
    worker.model.load_state_dict(state["model"])
    worker.optimizer.load_state_dict(state["optimizer"])
    worker.num_updates = state["num_updates"]
