r"""Trained policies out: a run's checkpoint -> Hugging Face directories (``megamarl-convert --from run``).

    megamarl-convert --from run --to hf runs/<name> exported/                # latest checkpoint, all policies
    megamarl-convert --from run --to hf runs/<name>/checkpoints/step_000040 out/ \
        --policy solver --dtype bfloat16

Input: a run directory (its latest complete checkpoint) or one ``<run>/checkpoints/step_N``; the run's
``config.yaml`` says each policy's base model and LoRA adapters. Output: ``<dst>/<policy>/`` (an HF /
vLLM model directory), ``<dst>/<policy>/adapters/<name>/`` (L2: one PEFT adapter per agent) and
``<dst>/megamarl_export.json``. Shards load at the export's ``--tp``/``--pp`` (any layout) and stream out
through the trainer's own HF mapping, cast to ``dtype``. Ranks: ``tp * pp`` spawned CPU/gloo ranks, or
the ranks ``torchrun`` launched. The output layout in full: docs/design-notes.md, "megamarl/cli/export.py".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from megamarl.cli.configure import load_config
from megamarl.errors import EXIT_CONFIG_ERROR
from megamarl.models import bridge, dist_checkpoint
from megamarl.models.convert import CONVERSION_TIMEOUT_S, conversion_worker_group, convert, copy_side_files
from megamarl.models.lora import LoraConfig, add_lora_adapter, save_peft_adapter
from megamarl.models.model_cache import atomic_dir
from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.launch import run_on_ranks
from megamarl.rollout.engines.lora_backends import policy_adapters
from megamarl.runtime import checkpoint as policy_io

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MANIFEST = "megamarl_export.json"


@dataclass(frozen=True)
class PolicyExport:
    """One policy's export job (picklable: it travels to the spawned ranks)."""

    name: str
    model_path: str  # the HF directory the policy started from (architecture, tokenizer)
    shards: str  # <checkpoint>/policies/<name>
    dst: str
    dtype: str
    lora: LoraConfig | None
    adapters: tuple[str, ...]


def find_run_checkpoint(src: str | Path) -> tuple[Path, Path]:
    """``src`` (a run directory or a checkpoint directory) -> (run directory, checkpoint directory)."""
    src = Path(src)
    if (src / policy_io.COMPLETE).is_file():
        return src.parent.parent, src
    found = policy_io.list_checkpoints(src)
    if not found:
        why = (
            "has no COMPLETE marker (an interrupted save)"
            if src.name.startswith("step_")
            else (f"holds no complete checkpoint under {policy_io.CHECKPOINTS}/")
        )
        raise ValueError(f"{src} {why}; give a run directory or <run>/{policy_io.CHECKPOINTS}/step_N")
    return src, found[-1]


def plan_exports(
    src: str | Path, dst: str | Path, *, policies: list[str] | None = None, dtype: str = "auto"
) -> list[PolicyExport]:
    """Which policies to export and from where; validates the request before any rank starts."""
    run_dir, ckpt = find_run_checkpoint(src)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{config_file} not found: the run directory holds the run's resolved config")
    cfg = load_config(config_file)
    trained = [name for name, p in cfg.policies.items() if not p.frozen]
    wanted = policies or trained
    unknown = [p for p in wanted if p not in trained]
    if unknown:
        raise ValueError(f"--policy {unknown}: not a trained policy of {run_dir}; trained: {trained}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype} unknown; allowed: auto, {', '.join(DTYPES)}")
    jobs = []
    for name in wanted:
        policy = cfg.policies[name]
        model_path = resolve_model_path(policy.model, key=f"policies.{name}.model")
        shards = ckpt / policy_io.POLICIES / name
        if not shards.is_dir():
            raise ValueError(f"checkpoint {ckpt} has no policy '{name}'")
        jobs.append(
            PolicyExport(
                name=name,
                model_path=str(model_path),
                shards=str(shards),
                dst=str(Path(dst) / name),
                dtype=_source_dtype(model_path) if dtype == "auto" else dtype,
                lora=policy.lora,
                adapters=tuple(policy_adapters(cfg, name)),
            )
        )
    return jobs


def _source_dtype(model_path: Path) -> str:
    """``auto``: the dtype the policy's source model was published in (fp32 when it does not say)."""
    config = json.loads((model_path / "config.json").read_text())
    found = config.get("dtype") or config.get("torch_dtype") or "float32"
    return found if found in DTYPES else "float32"


def export_run(
    src: str | Path,
    dst: str | Path,
    *,
    policies: list[str] | None = None,
    dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
) -> list[Path]:
    """Library entry point of ``megamarl-convert --from run --to hf``; returns the policy directories."""
    jobs = plan_exports(src, dst, policies=policies, dtype=dtype)
    _, ckpt = find_run_checkpoint(src)
    for job in jobs:
        with atomic_dir(job.dst) as tmp:  # a reader never sees a half-written export
            copy_side_files(Path(job.model_path), tmp, dtype=job.dtype)
            lines = [
                line
                for rank_lines in run_on_ranks(
                    export_policy_rank,
                    tp * pp,
                    replace(job, dst=str(tmp)),
                    tp,
                    pp,
                    timeout_s=CONVERSION_TIMEOUT_S,
                )
                for line in rank_lines
            ]
            if pp > 1:
                weight_map = dict(reversed(line.split("\t")) for line in lines)
                index = {"metadata": {}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    manifest = {
        "checkpoint": str(ckpt.resolve()),
        "step": policy_io.checkpoint_step(ckpt),
        "policies": {
            job.name: {"dtype": job.dtype, "source_model": job.model_path, "adapters": list(job.adapters)}
            for job in jobs
        },
    }
    Path(dst).mkdir(parents=True, exist_ok=True)
    (Path(dst) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return [Path(job.dst) for job in jobs]


def export_policy_rank(rank: int, job: PolicyExport, tp: int, pp: int) -> list[str]:
    """Body on each rank: build, add the adapters, load the shards, stream HF tensors; the stage
    senders write the weights, the first stage's sender the PEFT adapters. Returns index lines."""
    wg = conversion_worker_group(tp, pp)
    model = bridge.build_model(job.model_path, wg, init_weights=False, lora=bool(job.adapters))
    for adapter in job.adapters:  # same parameters as the trainer's model, so the shards match
        assert job.lora is not None  # a policy with adapters has its LoRA config
        add_lora_adapter(model, wg, adapter, job.lora)
    dist_checkpoint.load_checkpoint(job.shards, model, wg)
    dtype = DTYPES[job.dtype]
    tensors = {name: t.to(dtype).contiguous() for name, t in bridge.export_hf_weights(model, wg)}
    for adapter in job.adapters:  # collective over the WG (TP gathers, PP gather)
        save_peft_adapter(
            model,
            wg,
            adapter,
            Path(job.dst) / "adapters" / adapter,
            base_model_name_or_path=str(Path(job.dst).resolve()),
            dtype=dtype,
        )
    if not bridge.is_sender(wg):
        return []
    file = "model.safetensors" if pp == 1 else f"model-{wg.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    save_file(tensors, str(Path(job.dst) / file), metadata={"format": "pt"})
    return [f"{file}\t{name}" for name in tensors]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megamarl-convert",
        description="Convert between Hugging Face, Megatron torch_dist and a run's checkpoints.",
    )
    parser.add_argument(
        "--from",
        dest="from_format",
        choices=["run", "hf", "megatron"],
        required=True,
        help="run: a training run's checkpoint (runs/<name> or runs/<name>/checkpoints/step_N)",
    )
    parser.add_argument("--to", dest="to_format", choices=["hf", "megatron"], required=True)
    parser.add_argument(
        "--policy",
        action="append",
        default=None,
        help="--from run: export this policy (repeatable; default: every trained policy)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight dtype of the HF output (--from run default: auto = the source model's; else float32)",
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size of the ranks doing the conversion"
    )
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline parallel size of the ranks doing the conversion"
    )
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    try:
        if args.from_format == "run":
            if args.to_format != "hf":
                raise ValueError("--from run exports to --to hf only")
            for out in export_run(
                args.src, args.dst, policies=args.policy, dtype=args.dtype or "auto", tp=args.tp, pp=args.pp
            ):
                print(f"wrote {out}", file=sys.stderr)
            return
        if args.policy:
            raise ValueError("--policy applies to --from run only")
        dtype = args.dtype if args.dtype not in (None, "auto") else "float32"
        out = convert(
            args.src,
            args.dst,
            from_format=args.from_format,
            to_format=args.to_format,
            tp=args.tp,
            pp=args.pp,
            dtype=dtype,
        )
    except ValueError as exc:
        print(f"megamarl-convert: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
