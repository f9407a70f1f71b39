"""The front door of a launch (``scripts/train.py``, ``scripts/evaluate.py``): the checks that need
more than the config, and the one-line config error (docs/reliability.md, "The front door").

transformers is imported only when ``allowed_tokens`` need a tokenizer (it is what a config error
would otherwise wait for).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from megamarl.config import RunConfig, config_error_line
from megamarl.errors import EXIT_CONFIG_ERROR
from megamarl.models.packaged import resolve_model_path
from megamarl.models.spec import layer_spec_choice, transformer_engine_importable
from megamarl.orchestration.agents import check_allowed_tokens
from megamarl.planning.dryrun import declared_world_size, training_setup
from megamarl.planning.expert_plan import check_moe_training
from megamarl.rollout.engine_placement import ReplicaPlacement, plan_engines, ranks_per_node
from megamarl.rollout.engines.lora_backends import check_lora_backends
from megamarl.runtime import checkpoint

# Under torchrun every rank runs the same checks; a rank other than 0 waits this long before it
# reports, so that when every rank fails alike torchrun has already stopped it (after rank 0's exit)
# and the user reads one line, not one per rank (docs/reliability.md, "The front door").
QUIET_RANK_GRACE_S = 5.0


def launch_world(cfg: RunConfig, *, check: bool) -> int:
    """The world this launch runs on: torchrun's WORLD_SIZE. ``--check`` outside torchrun (run before
    launching it, e.g. in a batch script) checks against the world the config declares instead
    (``planning.dryrun.declared_world_size``): a 2-rank config is not an error there."""
    if "WORLD_SIZE" in os.environ or not check:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return declared_world_size(cfg)


def preflight(cfg: RunConfig, *, world_size: int) -> dict[str, list[ReplicaPlacement]]:
    """The checks of a training launch that need more than the config: no MoE policy (planned only for
    now: ``planning.expert_plan.check_moe_training``), placement on this world,
    the run directory, the resume checkpoint, single-token ``allowed_tokens`` (tokenizers only).
    Nothing here builds a model or engine; the one write is the run directory probe, last, once
    everything else passed (a refused launch leaves an existing run directory as it was). Returns the
    engine plan, computed once per run: the launch hands it to the trainer."""
    check_moe_training(cfg)  # MoE policies are planned, not yet trained: stop before anything else
    plan = plan_engines(cfg, world_size, ranks_per_node(cfg.cluster, world_size))  # WG and engine placement
    check_lora_backends(cfg, on_gpu=torch.cuda.is_available())
    check_layer_specs(
        cfg,
        cuda=torch.cuda.is_available(),
        transformer_engine=transformer_engine_importable(),
        triton=importlib.util.find_spec("triton") is not None,
    )
    run_dir = Path(cfg.output_dir) / cfg.name
    resume = checkpoint.find_checkpoint(cfg.trainer.resume, run_dir)
    if resume is not None:
        checkpoint.validate_checkpoint(resume, cfg.policies)
    constrained = {a.policy for a in cfg.agents.values() if a.sampling.allowed_tokens}
    if constrained:  # the tokenizers alone (no model): allowed_tokens must be one token each
        from transformers import AutoTokenizer  # heavy: only for configs that constrain tokens

        check_allowed_tokens(
            cfg.agents,
            {
                name: AutoTokenizer.from_pretrained(
                    resolve_model_path(cfg.policies[name].model, key=f"policies.{name}.model")
                )
                for name in sorted(constrained)
            },
        )
    checkpoint.check_run_dir(run_dir)  # last: its probe is the only write (a temporary directory, removed)
    return plan


def check_layer_specs(cfg: RunConfig, *, cuda: bool, transformer_engine: bool, triton: bool = True) -> None:
    """Refuse a node that would build a policy on another layer spec than the memory plan counted.
    The plan (``planning.dryrun.training_setup``) counts Transformer Engine's spec for every non-LoRA
    policy on GPUs; without TE this node would build megatron-core's local spec, whose attention keeps
    the fp32 softmax scores [B, heads, T, T] of every layer (a 70B executor: ~179 GiB per GPU). A
    ``prefix_tree`` policy on CUDA runs flex attention compiled by ``torch.compile``: it needs triton."""
    for name, policy in cfg.policies.items():
        if policy.frozen:  # served by its engines only: no Megatron model is built
            continue
        planned = training_setup(cfg, name, on_gpus=cuda).spec
        built = layer_spec_choice(
            lora=policy.lora is not None, cuda=cuda, transformer_engine=transformer_engine
        )
        if policy.prefix_tree and cuda and not triton:
            raise ValueError(
                f"policies.{name}.prefix_tree: tree attention on CUDA is flex attention compiled by "
                "torch.compile, whose GPU kernels need triton, which is not importable on this node: install "
                f"the triton that matches this torch (CUDA torch wheels ship it) or set policies.{name}."
                "prefix_tree: false"
            )
        if planned == "te" and built != "te":
            raise ValueError(
                f"policies.{name}: the memory plan counts Transformer Engine's layer spec on GPUs, but "
                "transformer_engine is not importable on this node, which would build megatron-core's local "
                "spec (fp32 attention scores, far over the plan). Install the GPU extra (pip install "
                "--no-build-isolation 'megamarl[gpu]', docs/install.md) or run in an NGC PyTorch image"
            )


def report_config_error(exc: BaseException) -> int:
    """One line on stderr, exit code 2. Under torchrun only rank 0 reports at once; another rank
    reports after QUIET_RANK_GRACE_S, which it lives to do only if rank 0 did not fail alike."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(QUIET_RANK_GRACE_S)
    print(f"config error{f' (rank {rank})' if rank else ''}: {config_error_line(exc)}", file=sys.stderr)
    return EXIT_CONFIG_ERROR
