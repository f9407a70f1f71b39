"""Convert checkpoints between Hugging Face and Megatron (megatron-core ``dist_checkpointing``).

    megamarl-convert --from run --to hf [--policy P ...] [--dtype bfloat16] RUN_OR_CHECKPOINT_DIR DST
    megamarl-convert --from hf --to megatron --tp 2 --pp 2 SRC_HF_DIR DST
    megamarl-convert --from megatron --to hf [--tp 1 --pp 1] [--dtype D] SRC DST_HF_DIR

``--from run`` exports a training run's policies (see ``megamarl.cli.export``). The Megatron side is
``config.json`` and tokenizer files plus ``megatron/`` (a ``torch_dist`` checkpoint, layout-free: the
``--tp/--pp`` it loads at need not match the one it was saved at). Ranks: ``tp * pp`` spawned CPU/gloo
ranks, or in place under ``torchrun`` (``RANK`` set). HF output: one safetensors file per pipeline
stage plus an index, or ``model.safetensors`` for one stage.
Details: docs/design-notes.md, "megamarl/models/convert.py".
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from megamarl.models import bridge, dist_checkpoint
from megamarl.models.mapping import hf_param_names
from megamarl.models.model_cache import atomic_dir
from megamarl.parallel import launch
from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

MEGATRON_SUBDIR = "megatron"
_COPY_SKIP = (".safetensors", ".bin", ".pt", ".index.json")


def copy_side_files(src: Path, dst: Path, *, dtype: str | None = None) -> None:
    """config, tokenizer, chat template, generation config... everything that is not a weight file,
    into a fresh ``dst``; with ``dtype``, config.json says the weights' new dtype."""
    if dst.exists():
        shutil.rmtree(dst)  # no stale weight files from an earlier write with another layout
    dst.mkdir(parents=True)
    for file in src.iterdir():
        # dot files are megamarl's own markers (the model cache's completion marker), not the model's
        if file.is_file() and not file.name.endswith(_COPY_SKIP) and not file.name.startswith("."):
            shutil.copy2(file, dst / file.name)
    if dtype is not None:
        config = json.loads((dst / "config.json").read_text())
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _progress(iterable, *, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def conversion_worker_group(tp: int, pp: int):
    """One WG over the whole world (the converter's world is exactly tp * pp ranks, checked at start)."""
    layout = WorkerGroupLayout(ranks=list(range(tp * pp)), tp=tp, pp=pp)
    return build_worker_groups(PlacementConfig({"convert": layout}))["convert"]


def hf_to_megatron(rank: int, src: str, dst: str, tp: int, pp: int) -> None:
    """Body on each rank: build the sharded model, fill it from ``src`` (HF), save ``dst/megatron``."""
    wg = conversion_worker_group(tp, pp)
    model = bridge.build_model(src, wg, init_weights=False)
    bridge.load_hf_weights(model, src, wg)
    if rank == 0:
        print(f"saving torch_dist checkpoint (tp={tp}, pp={pp}) to {dst}/{MEGATRON_SUBDIR}", file=sys.stderr)
    dist_checkpoint.save_checkpoint(Path(dst) / MEGATRON_SUBDIR, model, wg)


def megatron_to_hf(rank: int, src: str, dst: str, tp: int, pp: int, dtype: str = "float32") -> list[str]:
    """Body on each rank: load ``src/megatron`` at tp x pp, stream HF tensors, senders write files."""
    wg = conversion_worker_group(tp, pp)
    model = bridge.build_model(src, wg, init_weights=False)
    dist_checkpoint.load_checkpoint(Path(src) / MEGATRON_SUBDIR, model, wg)
    sender = bridge.is_sender(wg)
    total = len(hf_param_names(bridge.unwrap(model).hf_arch))
    stream = _progress(
        bridge.export_hf_weights(model, wg), total=total, desc=f"stage {wg.pp_rank} -> HF", enabled=sender
    )
    tensors = {name: tensor.to(getattr(torch, dtype)).contiguous() for name, tensor in stream}
    if not sender:
        return []
    file = "model.safetensors" if pp == 1 else f"model-{wg.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    save_file(tensors, str(Path(dst) / file), metadata={"format": "pt"})
    return [f"{file}\t{name}" for name in tensors]


CONVERSION_TIMEOUT_S = 3600  # a conversion rank's whole life (a large model's load and write)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    from_format: str,
    to_format: str,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
) -> Path:
    """Library entry point of the single-model conversions (same arguments as the CLI); returns ``dst``."""
    src, final = Path(src), Path(dst)
    if (from_format, to_format) not in (("hf", "megatron"), ("megatron", "hf")):
        raise ValueError(
            f"--from {from_format} --to {to_format} unsupported; allowed: hf->megatron, megatron->hf, run->hf"
        )
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json")
    if final.resolve() == src.resolve():
        raise ValueError(f"{final}: the output directory must differ from the input")
    with atomic_dir(final) as staging:  # readers never see a half-converted checkpoint
        copy_side_files(src, staging)
        if from_format == "hf":
            launch.run_on_ranks(
                hf_to_megatron, tp * pp, str(src), str(staging), tp, pp, timeout_s=CONVERSION_TIMEOUT_S
            )
            (staging / "megamarl_convert.json").write_text(json.dumps({"saved_tp": tp, "saved_pp": pp}))
            return final
        (staging / "megamarl_convert.json").unlink(missing_ok=True)
        per_rank = launch.run_on_ranks(
            megatron_to_hf, tp * pp, str(src), str(staging), tp, pp, dtype, timeout_s=CONVERSION_TIMEOUT_S
        )
        lines = [line for rank_lines in per_rank for line in rank_lines]
        if pp > 1 and lines:
            weight_map = dict(reversed(line.split("\t")) for line in lines)
            (staging / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
            )
    return final
