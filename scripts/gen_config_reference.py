"""Write docs/config_reference.md: every key of the run config, generated from the schema.

    python scripts/gen_config_reference.py           # rewrite docs/config_reference.md
    python scripts/gen_config_reference.py --check   # exit 1 when the committed file is stale

The reference is read off ``megamarl.config.RunConfig`` by introspection: dataclass fields (wherever
the classes live), their types and defaults, and the comment on or above each field in the source.
A section per top-level key; ``<name>`` stands for a map key (a policy's or an agent's name).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from pathlib import Path

from omegaconf import MISSING

from megamarl.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config_reference.md"
HEADER = """# Config reference

Generated from the schema (`megamarl.config.RunConfig`) by `python scripts/gen_config_reference.py`;
`tests/unit/test_config_reference.py` fails when this file is stale. How configs are composed and
overridden: [configs.md](configs.md). `<name>` is a map key you choose (a policy's or an agent's name).
Defaults are the schema's; `???` marks a value you must set. Cross-field rules (a layout that cannot
be placed, an agent naming an undefined policy, registry names) are checked at load time and the error
names the key.
"""


def _names(registry) -> str:
    """The built-in names: registered by megamarl's own modules, not by plugins or test helpers
    (``tests/scripted.py``) that the process happens to have imported."""

    def builtin(name: str) -> bool:
        return getattr(registry.get(name), "__module__", "").startswith("megamarl.")

    return ", ".join(f"`{n}`" for n in registry.names() if builtin(n))


def descriptions() -> dict[str, str]:
    """For keys whose source has no comment; registry-backed keys list the built-in names (plugins
    add more). A comment in the schema's source wins over an entry here."""
    import megamarl.orchestration  # noqa: F401 - registers the built-in agents, envs, orchestras
    from megamarl.driver.schedules import SCHEDULES
    from megamarl.orchestration.agents import AGENTS
    from megamarl.orchestration.env import ENVS
    from megamarl.orchestration.orchestras import ORCHESTRAS
    from megamarl.orchestration.workers import WORKERS
    from megamarl.parallel.placement import PLACEMENT_MODES
    from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS, GROUP_KEYS
    from megamarl.rl.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
    from megamarl.rollout import ENGINES

    ENGINE_BACKENDS = [n for n in ENGINES.names() if ENGINES.traits(n).configurable]
    TRAINER_MODES = SCHEDULES.names()

    p, a = "policies.<name>.", "agents.<name>."
    return {
        "name": "run name: output goes to `<output_dir>/<name>/`",
        "output_dir": "parent directory of run directories",
        "placement_mode": f"{', '.join(PLACEMENT_MODES)}: engines share the WG's devices or sit on ranks of "
        "their own (docs/cluster.md)",
        p + "tp": "tensor-parallel size of the policy's worker group",
        p + "pp": "pipeline-parallel size (DP = len(ranks) / (tp * pp))",
        p + "lr": "peak learning rate of megatron-core's Adam (lr_schedule: warmup and decay around it)",
        p + "weight_decay": "decoupled weight decay on matrices (none on norms and biases)",
        p + "grad_clip": "global gradient-norm clip",
        p + "micro_batch_size": "samples per forward/backward micro-batch",
        p + "ppo_epochs": "passes over each step's samples",
        p + "clip_low": "PPO ratio clip below 1 (1 - clip_low)",
        p + "clip_high": "PPO ratio clip above 1 (1 + clip_high; DAPO clip-higher)",
        p + "kl_coef": "weight of the KL to the reference policy (>0 builds a frozen copy; LoRA: the base)",
        p + "entropy_coef": "entropy bonus weight",
        p + "frozen": "never trained: acts only (no optimizer, not checkpointed)",
        p + "lora.rank": "LoRA rank r (L2: one adapter per agent naming `agents.<name>.lora`)",
        p + "lora.alpha": "LoRA scaling alpha (update = alpha / r * B A x)",
        p + "lora.targets": "linears with adapters: qkv, proj, fc1, fc2",
        p + "engine.backend": " | ".join(ENGINE_BACKENDS),
        p + "engine.num_replicas": "engine replicas of this policy (least-loaded routing)",
        p + "engine.tp": "tensor-parallel size of each engine replica (its ranks sit on one node)",
        p + "engine.max_num_seqs": "concurrent sequences per replica (continuous batching)",
        a + "policy": "the policy this agent samples from and trains (a key of `policies`)",
        a + "kind": f"registered agent kind (parser, prompts): {_names(AGENTS)}; empty: the env's default",
        a + "sampling.temperature": "sampling temperature (also applied to the trainer's logprobs)",
        a + "sampling.top_p": "nucleus sampling",
        a + "sampling.top_k": "top-k sampling; -1: off",
        a + "sampling.max_tokens": "response length cap in tokens",
        a + "multi_turn": "keep the agent's own chat transcript across its turns",
        a + "memory_tokens": "budget of earlier turns shown in the prompt; 0: none",
        a + "memory_scope": "team: every agent's earlier turns; self: its own only",
        a + "max_prompt_tokens": "longer prompts drop the episode (counted)",
        a + "choices": "names a router agent may pick",
        a + "frozen": "acts but its samples never train the policy",
        a + "system_prompt": "system turn; null: the agent kind's default",
        a + "prompt_template": "user turn, `{observation}` is replaced; null: the kind's default",
        **{
            a + k: f"per-agent override of `policies.<name>.{k}`; null: inherit"
            for k in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "micro_batch_size")
        },
        "logger.wandb.entity": "wandb entity (team); null: your default",
        "env.name": f"registered env: {_names(ENVS)}",
        "env.kwargs": "the env's own typed config (unknown keys are rejected at load time)",
        "orchestra.name": f"registered orchestra: {_names(ORCHESTRAS)}",
        "orchestra.kwargs": "the orchestra's own typed config",
        "rollout.max_concurrency": "episodes in flight at once",
        "rollout.env_timeout_s": "an env step in an env worker (`rollout.env_workers`, not `inline`) slower "
        "than this "
        "fails the episode (its worker is replaced)",
        "rollout.env_workers.backend": f"env worker backend: {_names(WORKERS)}; steps of envs with "
        "`remote_step` "
        "(`code`) run there (docs/performance.md)",
        "algorithm.estimator": f"advantage estimator: {_names(ADVANTAGE_ESTIMATORS)} (docs/rl.md)",
        "algorithm.group_by": f"index columns that form a GRPO group, from {', '.join(GROUP_KEYS)}",
        "algorithm.normalize_std": "divide advantages by the group's std (false: Dr.GRPO style)",
        "algorithm.turn_gamma": "discount of the reward over an agent's turns",
        "algorithm.invalid_penalty": "added to the reward of an unparseable action",
        "algorithm.dynamic_sampling": "drop groups whose rewards do not vary",
        "algorithm.loss_agg": f"loss aggregation: {_names(LOSS_AGGREGATIONS)}",
        "algorithm.kl_type": f"KL estimator: {_names(KL_ESTIMATORS)}",
        "algorithm.estimator_kwargs": "the estimator's own settings (e.g. gamma, lam for gae)",
        "eval.num_tasks": "held-out tasks per evaluation; 0: no eval",
        "eval.temperature": "sampling temperature at eval (0: greedy)",
        "trainer.total_steps": "training steps (rollout + update + sync each)",
        "trainer.mode": " | ".join(TRAINER_MODES) + " (docs/async.md)",
        "trainer.seed": "seeds tasks, sampling and initialisation",
        "logger.wandb.project": "wandb project",
        "logger.progress": "rich progress bar on the driver",
        "cluster.num_nodes": "nodes of the declared cluster (--dry-run)",
        "cluster.gpu_memory_gib": "memory per GPU of the declared cluster",
    }


def field_comments(cls: type) -> dict[str, str]:
    """``name -> comment`` from the class source: a trailing ``# ...`` on the field's line, else the
    ``# ...`` lines right above it. Fields a dataclass inherits take their base's comments."""
    comments: dict[str, str] = {}
    for klass in cls.__mro__[1:]:
        if dataclasses.is_dataclass(klass):
            for name, text in _own_comments(klass).items():
                comments.setdefault(name, text)
    return {**comments, **{k: v for k, v in _own_comments(cls).items() if v or k not in comments}}


def _own_comments(cls: type) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    comments, above = {}, []
    for line in lines:
        stripped = line.strip()
        match = re.match(r"(\w+)\s*:\s*[^=#]+(=[^#]*)?(#\s*(.*))?$", stripped)
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
        elif match and not stripped.startswith(("def ", "return ", "class ")):
            text = match.group(4) or " ".join(above)
            comments.setdefault(match.group(1), text.strip())
            above = []
        else:
            above = []
    return comments


def _unwrap_optional(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:  # Optional[X], X | None
        return args[0], True
    return hint, False


def _type_name(hint) -> str:
    inner, optional = _unwrap_optional(hint)
    if dataclasses.is_dataclass(inner):
        name = "section"
    elif typing.get_origin(inner) in (list, tuple):
        name = f"list[{', '.join(_type_name(a) for a in typing.get_args(inner)[:1])}]"
    elif typing.get_origin(inner) is dict:
        key, value = typing.get_args(inner)
        name = f"dict[{_type_name(key)}, {_type_name(value)}]"
    elif inner is typing.Any:
        name = "any"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} \\| null" if optional else name


def _default(field: dataclasses.Field, owner=None) -> str:
    if owner is not None:  # a section built by its parent's default_factory: its own values
        value = getattr(owner, field.name)
    elif field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "???"
    if value is MISSING or value == "???":
        return "???"
    if dataclasses.is_dataclass(value):
        return ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value!r}`".replace("|", "\\|") if isinstance(value, (str, list, dict, tuple)) else f"`{value}`"


def rows(cls: type, prefix: str, extra: dict[str, str], owner=None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every field of ``cls``, nested sections expanded; ``owner``:
    the section's default instance when its parent's factory sets values other than ``cls``'s defaults."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        key = f"{prefix}{field.name}"
        inner, optional = _unwrap_optional(hint)
        doc = (comments.get(field.name) or extra.get(key, "")).replace("|", "\\|")
        if dataclasses.is_dataclass(inner):
            if optional:
                out.append((key, "section \\| null", "null", doc or "set it to enable; keys below"))
            section = getattr(owner, field.name) if owner is not None else None
            if section is None and field.default_factory is not dataclasses.MISSING:
                section = field.default_factory()
            out.extend(rows(inner, f"{key}.", extra, section))
            continue
        value = typing.get_args(inner)[1] if typing.get_origin(inner) is dict else None
        if value is not None and dataclasses.is_dataclass(value):
            out.append((key, f"map of {value.__name__}", "`{}`", doc))
            out.extend(rows(value, f"{key}.<name>.", extra))
            continue
        out.append((key, _type_name(hint), _default(field, owner), doc))
    return out


def render() -> str:
    parts = [HEADER]
    top = rows(RunConfig, "", descriptions())
    scalars = [r for r in top if "." not in r[0]]
    sections: dict[str, list] = {}
    for row in top:
        if "." in row[0]:
            sections.setdefault(row[0].split(".")[0], []).append(row)
    table = ["| key | type | default | description |", "|---|---|---|---|"]
    parts.append(
        "## Top level\n\n"
        + "\n".join(table + [f"| `{k}` | {t} | {d} | {c} |" for k, t, d, c in scalars if k not in sections])
        + "\n"
    )
    for name, section_rows in sections.items():
        lines = [f"## `{name}`\n"] + table + [f"| `{k}` | {t} | {d} | {c} |" for k, t, d, c in section_rows]
        parts.append("\n".join(lines) + "\n")
        if name == "orchestra":
            parts.extend(orchestra_kwargs(table))
    return "\n".join(parts)


def orchestra_kwargs(table: list[str]) -> list[str]:
    """One table per built-in orchestra: its ``Config`` fields, the keys ``orchestra.kwargs`` takes
    (validated at load time; an unknown key is rejected)."""
    import megamarl.orchestration  # noqa: F401 - registers the built-in orchestras
    from megamarl.orchestration.orchestras import ORCHESTRAS

    parts = []
    for name in ORCHESTRAS.names():
        cls = ORCHESTRAS.get(name)
        if not getattr(cls, "__module__", "").startswith("megamarl."):
            continue
        config_rows = rows(cls.Config, "orchestra.kwargs.", {})
        body = (
            table + [f"| `{k}` | {t} | {d} | {c} |" for k, t, d, c in config_rows]
            if config_rows
            else ["(no keys)"]
        )
        parts.append("\n".join([f"### `orchestra.kwargs` of `{name}`\n", *body]) + "\n")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config_reference.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
