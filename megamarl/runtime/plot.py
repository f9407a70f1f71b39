"""PNG plots of a run from its local logs (``metrics.jsonl``, ``eval.json``): no wandb account needed.

``python -m megamarl.runtime.plot RUN_DIR`` (or ``megamarl-plot RUN_DIR``) writes into ``RUN_DIR/plots``:

- ``rewards.png``: one curve per agent of ``agent/<name>/reward_mean`` (and ``agent/<name>/success``
  in a second panel when logged); noisy curves get a moving average over the raw points;
- ``timing.png``: where each step's time goes, ``timing/*_s`` stacked per step, with
  ``timing/step_s`` as the total line;
- ``training.png``: small multiples of the loss-side metrics that were logged (``kl``, ``entropy``,
  ``clip_frac``, ``invalid_rate``, per-agent ``pg_loss`` / ``response_len``, per-policy ``grad_norm``);
- ``eval.png`` (when ``eval.json`` exists): each eval metric over steps, with the first evaluation
  (the base model) as a dashed reference line.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display (clusters, CI)
import matplotlib.pyplot as plt  # noqa: E402

from megamarl.runtime.metrics import read_eval, read_metrics  # noqa: E402

TIMING_ORDER = ("rollout", "logprob", "update", "weight_sync", "idle")
TRAINING_KEYS = ("kl", "entropy", "clip_frac", "invalid_rate")
PER_AGENT_TRAINING = ("pg_loss", "response_len")
PER_POLICY_TRAINING = ("grad_norm", "loss")


def plot_run(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Draw every plot the run's logs support; return the written PNG paths."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is this a megamarl run directory?)")
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    series = _series(read_metrics(run_dir))
    title = run_dir.resolve().name
    written = []
    for name, draw in (("rewards", _rewards), ("timing", _timing), ("training", _training)):
        fig = draw(series, title)
        if fig is not None:
            written.append(_save(fig, out_dir / f"{name}.png"))
    evals = read_eval(run_dir)
    if evals:
        written.append(_save(_eval(evals, title), out_dir / "eval.png"))
    return written


def _series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values), skipping nulls (non-finite values)."""
    out: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for record in records:
        for key, value in record.items():
            if key in ("step", "time", "elapsed_s") or not isinstance(value, (int, float)):
                continue
            out[key][0].append(record["step"])
            out[key][1].append(float(value))
    return dict(out)


def _per_name(series, prefix: str, metric: str) -> dict[str, tuple[list[int], list[float]]]:
    pattern = re.compile(rf"^{prefix}/(.+)/{metric}$")
    return {m.group(1): v for k, v in series.items() if (m := pattern.match(k))}


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _curves(ax, curves: dict[str, tuple[list[int], list[float]]], ylabel: str) -> None:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, (steps, values)) in enumerate(sorted(curves.items())):
        color = colors[i % len(colors)]
        if len(values) > 20:  # raw points faint, moving average bold
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, _smooth(values, max(3, len(values) // 10)), color=color, linewidth=2, label=name)
        else:
            ax.plot(steps, values, color=color, linewidth=2, marker="o", markersize=3, label=name)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _rewards(series, title: str):
    rewards = _per_name(series, "agent", "reward_mean")
    if not rewards:
        return None
    success = _per_name(series, "agent", "success")
    num_rows = 2 if success else 1
    fig, axes = plt.subplots(num_rows, 1, figsize=(8, 3.6 * num_rows), sharex=True, squeeze=False)
    _curves(axes[0, 0], rewards, "reward (mean)")
    axes[0, 0].set_title(f"{title}: reward per agent")
    if success:
        _curves(axes[1, 0], success, "success rate")
    axes[-1, 0].set_xlabel("step")
    return fig


def _timing(series, title: str):
    parts = {
        key[len("timing/"):-len("_s")]: v
        for key, v in series.items()
        if key.startswith("timing/") and key.endswith("_s")
    }
    total = parts.pop("step", None)
    if not parts:
        return None
    names = [n for n in TIMING_ORDER if n in parts] + sorted(n for n in parts if n not in TIMING_ORDER)
    steps = sorted({s for n in names for s in parts[n][0]})
    stacks = [[dict(zip(*parts[n])).get(s, 0.0) for s in steps] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if len(steps) > 1:
        ax.stackplot(steps, stacks, labels=[f"{n}" for n in names], alpha=0.85)
    else:
        bottom = 0.0
        for name, stack in zip(names, stacks):
            ax.bar(steps, stack, bottom=bottom, label=name)
            bottom += stack[0]
    if total is not None:
        ax.plot(total[0], total[1], color="black", linewidth=1.5, label="step (total)")
    ax.set_title(f"{title}: time per step")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncols=min(3, len(names) + 1))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the stack
    return fig


def _training(series, title: str):
    panels = {k: {"": series[k]} for k in TRAINING_KEYS if k in series}
    for metric in PER_AGENT_TRAINING:
        if curves := _per_name(series, "agent", metric):
            panels[f"agent {metric}"] = curves
    for metric in PER_POLICY_TRAINING:
        if curves := _per_name(series, "policy", metric):
            panels[f"policy {metric}"] = curves
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (name, curves) in zip(axes.flat, panels.items()):
        if list(curves) == [""]:
            steps, values = curves[""]
            ax.plot(steps, values, linewidth=1.5)
            ax.grid(alpha=0.3)
        else:
            _curves(ax, curves, "")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{title}: training")
    return fig


def _eval(entries: list[dict], title: str):
    entries = sorted(entries, key=lambda e: e["step"])
    keys = sorted({k for e in entries for k, v in e["results"].items() if v is not None})
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, key in enumerate(keys):
        points = [(e["step"], e["results"][key]) for e in entries if e["results"].get(key) is not None]
        steps, values = zip(*points)
        color = colors[i % len(colors)]
        label = key.removeprefix("eval/")
        label = f"{label}: {values[0]:.3g} -> {values[-1]:.3g}"
        ax.plot(steps, values, marker="o", color=color, linewidth=2, label=label)
        ax.axhline(values[0], color=color, linestyle="--", linewidth=1, alpha=0.6)
    ax.set_title(f"{title}: evaluation (dashed: base model at step {entries[0]['step']})")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def _save(fig, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a megamarl run's metrics.jsonl / eval.json to PNGs.")
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)


if __name__ == "__main__":
    main()
