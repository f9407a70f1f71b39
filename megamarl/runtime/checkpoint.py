"""The run checkpoint around the policies' shards (``runtime.checkpointer.Checkpointer``; see
docs/checkpointing.md).

One directory per saved step, ``<run_dir>/checkpoints/step_000040/``: ``policies/<policy>/`` (model +
AdamW in ``torch_dist``, any layout: ``megamarl.models.dist_checkpoint``), ``rng/rank_*.pt``,
``trainer.pt`` (step, weight versions, counts, the driver's totals and rollout_state),
``metrics_line.json`` (the step's metrics as they stood at the save) and ``COMPLETE``, written last.
Invariant: the directory appears atomically: ranks write ``step_N.partial``, the driver renames it,
so a crash leaves earlier checkpoints intact and at most a ``.partial`` that resume ignores.
Resume rewinds the run directory: later ``metrics.jsonl`` and ``trained_groups.jsonl`` lines and
``eval.json`` entries are cut, later complete checkpoints renamed ``*.discarded``, and the checkpoint's
own step logged from ``metrics_line.json`` when the run died before it logged it; a run from step 0 in
an earlier run's directory rewinds all.
The layout in full: docs/design-notes.md, "megamarl/runtime/checkpoint.py".
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from megamarl.config import PolicyConfig, RunConfig
from megamarl.errors import CheckpointWriteError  # noqa: F401 - the trainer raises it as checkpoint.CheckpointWriteError
from megamarl.models import dist_checkpoint as model_checkpoint  # looked up per call (tests swap in faults)
from megamarl.runtime.metrics import EVAL_FILE, METRICS_FILE, TRAINED_GROUPS_FILE
from megamarl.runtime.progress import format_duration

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer.pt"
METRICS_LINE = "metrics_line.json"  # the step's metrics line as it stood at the save (resume re-logs it)
POLICIES = "policies"
_STEP_DIR = re.compile(r"step_(\d+)")


# ---- where checkpoints are -----------------------------------------------------------------------


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def staging_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.fullmatch(path.name)
    assert match is not None, path  # called on step directories
    return int(match.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of ``run_dir``, oldest first (``.partial`` and marker-less ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def find_checkpoint(resume: str, run_dir: str | Path) -> Path | None:
    """``trainer.resume`` -> the checkpoint to load. ``none``: None. ``auto``: the latest complete
    checkpoint of ``run_dir`` (None when there is none: a fresh start). Otherwise a checkpoint
    directory, or a run directory whose latest complete checkpoint is taken."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if (path / COMPLETE).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    if not path.is_dir():
        why = "does not exist"
    elif _STEP_DIR.fullmatch(path.name.split(".")[0]):
        why = "has no COMPLETE marker (an interrupted save)"
    else:
        why = "holds no complete checkpoint"
    raise ValueError(
        f"trainer.resume={resume}: {why}; give a checkpoint directory (<run_dir>/{CHECKPOINTS}/step_N) "
        "or a run directory with complete checkpoints, or trainer.resume=auto"
    )


def check_run_dir(run_dir: Path, *, key: str = "output_dir") -> None:
    """Before anything is built: ``run_dir`` is a directory or can be created as one. Probed by
    creating (and removing) a temporary directory in its nearest existing ancestor (``run_dir``
    itself when it exists): ``os.access`` says yes to root on a read-only or pseudo filesystem."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{key}: the run directory {run_dir} exists and is not a directory")
    ancestor = run_dir
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{key}: cannot create the run directory {run_dir}: {ancestor} is a file")
    try:
        tempfile.TemporaryDirectory(dir=ancestor, prefix=".megamarl-probe-").cleanup()
    except OSError as exc:
        raise ValueError(
            f"{key}: cannot create the run directory {run_dir}: {ancestor} is not writable ({exc.strerror})"
        ) from None


def validate_checkpoint(path: Path, policies: dict[str, PolicyConfig]) -> None:
    """Before a resumed run builds anything or touches its run directory (``scripts/train.py``): the
    checkpoint ``trainer.resume`` names is whole. Checks, cheapest first: the COMPLETE marker parses;
    every file its manifest lists has the size the save wrote (checkpoints saved before the manifest
    skip this); ``trainer.pt`` loads; each trained policy's dist-checkpoint metadata loads and every
    storage item it lists lies inside its shard file. Not read: the tensor bytes themselves (a shard
    overwritten with garbage of the same size passes; hashing them would re-read the whole checkpoint
    at every save). Raises ValueError naming ``trainer.resume``, the checkpoint and the bad file."""

    def corrupt(what: str) -> ValueError:
        return ValueError(
            f"trainer.resume: checkpoint {path} is corrupt: {what}; resume from an earlier "
            f"checkpoint ({path.parent}/step_N) or start afresh (trainer.resume=none)"
        )

    try:
        marker = json.loads((path / COMPLETE).read_text(encoding="utf-8"))
        step = int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise corrupt(f"{COMPLETE} does not parse ({type(exc).__name__})") from None
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise corrupt(f"{name} is missing")
        if file.stat().st_size != size:
            raise corrupt(f"{name} has {file.stat().st_size} bytes, the save wrote {size}")
    try:
        state = load_trainer_state(path)
        if state["step"] != step:
            raise ValueError(f"step {state['step']} != the marker's {step}")
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything (UnpicklingError, EOFError, ...)
        raise corrupt(f"{TRAINER_STATE} does not load ({type(exc).__name__}: {str(exc)[:100]})") from None
    trained = [name for name, policy in policies.items() if not policy.frozen]
    missing = [name for name in trained if not (path / POLICIES / name).is_dir()]
    if missing:
        have = sorted(p.name for p in (path / POLICIES).iterdir()) if (path / POLICIES).is_dir() else []
        raise ValueError(f"trainer.resume: checkpoint {path} has no policies {missing}; it has {have}")
    for name in trained:
        policy_dir = path / POLICIES / name
        try:
            # imported here: torch.distributed.checkpoint pulls in sympy (~2 CPU-s), which a config
            # error reported by the front door would otherwise wait for
            from torch.distributed.checkpoint import FileSystemReader

            metadata = FileSystemReader(str(policy_dir)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - as above
            raise corrupt(f"{POLICIES}/{name}/.metadata does not load ({type(exc).__name__})") from None
        sizes: dict[str, int] = {}
        for item in metadata.storage_data.values():
            shard = policy_dir / item.relative_path
            if item.relative_path not in sizes:
                sizes[item.relative_path] = shard.stat().st_size if shard.is_file() else -1
            if sizes[item.relative_path] < item.offset + item.length:
                raise corrupt(
                    f"{POLICIES}/{name}/{item.relative_path} holds {max(sizes[item.relative_path], 0)} "
                    f"bytes, its metadata needs {item.offset + item.length}"
                )


# ---- policies (collective over all ranks) --------------------------------------------------------


CRITIC_FILE = "value_head.pt"  # GAE critic: value head + its optimizer (TP/DP-replicated, last stage)
ADAPTER_STEPS_FILE = "adapter_steps.json"  # L2: each adapter's Adam step count (rl.adapters)


def save_policies(path: Path, policies: dict[str, PolicyConfig], workers: dict, wgs: dict) -> None:
    """Every trained policy's model + optimizer under ``path/policies/<name>``. Collective: every
    rank calls it; ranks outside a policy's WG contribute nothing to that policy."""
    for name, policy in policies.items():
        if policy.frozen:
            continue
        worker = workers.get(name)
        # megatron-core saves one step count for all parameters; L2 adapters keep their own beside it
        with worker.adapter_steps.checkpoint_steps() if worker else contextlib.nullcontext({}) as steps:
            model_checkpoint.save_checkpoint(
                path / POLICIES / name,
                worker.model if worker else None,
                wgs[name],
                optimizer=worker.optimizer if worker else None,
            )
        if steps and wgs[name].tp_rank == 0 and wgs[name].dp_rank == 0 and wgs[name].pp_rank == 0:
            (path / POLICIES / name / ADAPTER_STEPS_FILE).write_text(json.dumps(steps))
        critic = worker.critic.state() if worker else None
        if critic is not None and wgs[name].tp_rank == 0 and wgs[name].dp_rank == 0:
            torch.save(critic, path / POLICIES / name / CRITIC_FILE)  # replicated: one writer


def load_policies(path: Path, policies: dict[str, PolicyConfig], workers: dict, wgs: dict) -> None:
    """Load every trained policy from ``path`` at this run's layout (any TP/PP/DP). Collective."""
    trained = [name for name, policy in policies.items() if not policy.frozen]
    missing = [name for name in trained if not (path / POLICIES / name).is_dir()]
    if missing:  # every rank sees the same directory, so every rank raises (no hang)
        have = sorted(p.name for p in (path / POLICIES).iterdir()) if (path / POLICIES).is_dir() else []
        raise ValueError(f"trainer.resume: checkpoint {path} has no policies {missing}; it has {have}")
    for name in trained:
        worker = workers.get(name)
        if worker is not None:  # every rank of the WG reads the same file: all raise, none hangs
            check_adapters(path / POLICIES / name / ADAPTER_STEPS_FILE, name, worker.adapter_steps.adapters)
        model_checkpoint.load_checkpoint(
            path / POLICIES / name,
            worker.model if worker else None,
            wgs[name],
            optimizer=worker.optimizer if worker else None,
        )
        if worker is not None and worker.adapter_steps.adapters:
            _load_adapter_steps(path / POLICIES / name / ADAPTER_STEPS_FILE, worker)
        if worker is not None and worker.critic.has_state:
            critic_file = path / POLICIES / name / CRITIC_FILE
            if not critic_file.is_file():
                raise ValueError(
                    f"trainer.resume: {critic_file} is missing; the run uses a critic "
                    "(algorithm.estimator=gae)"
                )
            worker.critic.load_state(torch.load(critic_file, weights_only=False))


def check_adapters(file: Path, policy: str, adapters: list[str]) -> None:
    """L2: the checkpoint (its ``adapter_steps.json``; older ones lack it and are not checked) holds
    every adapter the run configures; adding one at resume is refused, naming it."""
    if not file.is_file():
        return
    saved = json.loads(file.read_text())
    missing = sorted(set(adapters) - set(saved))
    if missing:
        raise ValueError(
            f"trainer.resume: checkpoint {file.parent.parent.parent} has no LoRA adapters {missing} of "
            f"policy '{policy}' (it has {sorted(saved)}); adding an adapter at resume is not supported: drop "
            f"agents.<a>.lora={missing[0]} or start afresh (trainer.resume=none)"
        )


def _load_adapter_steps(file: Path, worker) -> None:
    """Each L2 adapter's own step count after a load; a checkpoint without the file held one count for
    every adapter (the largest on any rank of the WG)."""
    if file.is_file():
        worker.adapter_steps.load_steps(json.loads(file.read_text()))
        return
    step = torch.tensor([float(worker.adapter_steps.local_step())])
    torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX, group=worker.wg.pgs.intra_dist_opt)
    worker.adapter_steps.total_steps = dict.fromkeys(worker.adapter_steps.adapters, int(step.item()))


# ---- RNG and run state ---------------------------------------------------------------------------


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(path: Path, rank: int) -> Path:
    return path / "rng" / f"rank_{rank:05d}.pt"


def save_rng(path: Path, rank: int) -> None:
    file = _rng_file(path, rank)
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), file)


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's generators; False when the checkpoint has no file for this rank (it was
    saved with fewer ranks): the caller seeds that rank afresh."""
    file = _rng_file(path, rank)
    if not file.is_file():
        return False
    set_rng_state(torch.load(file, weights_only=False))
    return True


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / TRAINER_STATE, weights_only=False)


def commit(staging: Path, final: Path, trainer_state: dict, line: dict[str, float] | None = None) -> None:
    """Driver only, after every rank wrote its shards into ``staging``: add the run state, the step's
    metrics line as it stands (``line``; None: none) and the marker, then rename ``staging`` to
    ``final`` in one step."""
    torch.save(trainer_state, staging / TRAINER_STATE)
    if line is not None:
        (staging / METRICS_LINE).write_text(json.dumps(line) + "\n", encoding="utf-8")
    # the manifest: every file's size, so resume can tell a truncated or replaced file before it loads
    files = {str(f.relative_to(staging)): f.stat().st_size for f in sorted(staging.rglob("*")) if f.is_file()}
    (staging / COMPLETE).write_text(json.dumps({"step": trainer_state["step"], "files": files}) + "\n")
    stale = None
    if final.exists():  # the same step saved again (a run resumed from an older checkpoint)
        stale = final.with_name(final.name + ".stale")
        clear(stale)
        os.replace(final, stale)
    os.replace(staging, final)
    if stale is not None:
        shutil.rmtree(stale)


def load_metrics_line(path: Path) -> dict[str, float]:
    """The step's metrics line the checkpoint carries ({} when it carries none)."""
    file = path / METRICS_LINE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def clear(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def prune(run_dir: str | Path, *, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all)."""
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)


def rewind_run_dir(run_dir: str | Path, step: int) -> None:
    """Make ``run_dir`` look as it did right after ``step`` was saved (see the module doc)."""
    run_dir = Path(run_dir)
    truncate_jsonl_after(run_dir / METRICS_FILE, step)
    truncate_jsonl_after(run_dir / TRAINED_GROUPS_FILE, step)
    eval_path = run_dir / EVAL_FILE
    if eval_path.is_file():
        entries = json.loads(eval_path.read_text(encoding="utf-8"))
        kept = [e for e in entries if e["step"] <= step]
        if len(kept) != len(entries):
            tmp = eval_path.with_name(eval_path.name + ".tmp")
            tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
            os.replace(tmp, eval_path)
    for later in list_checkpoints(run_dir):
        if checkpoint_step(later) > step:
            discarded = later.with_name(later.name + ".discarded")
            clear(discarded)
            os.replace(later, discarded)


def earlier_run(run_dir: str | Path) -> str:
    """What an earlier run left in ``run_dir`` ("2 metrics records, 1 eval entries, checkpoints up to
    step 2"), '' when nothing: a run that starts from step 0 there cuts it (``rewind_run_dir(-1)``)."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    num_records = len(metrics.read_bytes().splitlines()) if metrics.is_file() else 0
    evals = run_dir / EVAL_FILE
    num_evals = len(json.loads(evals.read_text(encoding="utf-8") or "[]")) if evals.is_file() else 0
    saved = list_checkpoints(run_dir)
    if not (num_records or num_evals or saved):
        return ""
    found = [f"{num_records} metrics records", f"{num_evals} eval entries"]
    if saved:
        found.append(f"checkpoints up to step {checkpoint_step(saved[-1])}")
    return ", ".join(found)


def closing_line(run_dir: Path, cfg: RunConfig, *, step: int, seconds: float) -> str:
    """A run's last line: how far and how long, and where what it wrote is (what exists of it)."""
    found = []
    saved = list_checkpoints(run_dir)
    if saved:
        found.append(f"checkpoint {saved[-1]}")
    for name in (METRICS_FILE, EVAL_FILE):
        if (run_dir / name).is_file():
            found.append(f"{name.split('.')[0]} {run_dir / name}")
    if cfg.logger.plots and any((run_dir / "plots").glob("*.png")):
        found.append(f"plots {run_dir / 'plots'}/*.png")
    where = f": {', '.join(found)}" if found else ""
    return f"finished at step {step}/{cfg.trainer.total_steps} in {format_duration(seconds)}{where}"


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Cut ``path`` at its first record with ``"step" > step`` or that does not parse (a line torn by
    a crash). In place, not by replacing the file: the metrics logger already holds it open for
    appending, and its next line lands at the new end."""
    if not path.is_file():
        return
    offset = 0
    with open(path, "rb+") as f:
        for line in f:
            try:
                record = json.loads(line)
                if record["step"] > step:
                    break
            except (ValueError, KeyError, TypeError):
                break
            offset += len(line)
        f.truncate(offset)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def attempt_write(write) -> str:
    """Run a checkpoint write; '' on success, else the error as one line (any exception: a
    collective writer may wrap the OSError of another rank)."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised as CheckpointWriteError
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return ""
