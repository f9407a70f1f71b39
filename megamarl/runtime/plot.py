"""PNG plots of a run from its local logs (``metrics.jsonl``, ``eval.json``): no wandb account needed.

``python -m megamarl.runtime.plot RUN_DIR`` (or ``megamarl-plot RUN_DIR``) writes into ``RUN_DIR/plots``
one figure per concern, every axis labelled, each agent and policy in the same colour in every figure
(colours follow sorted names, so two runs of one config match): ``rewards.png``, ``eval.png`` (held-out
rates, the first evaluation dashed as reference), ``training.png``, ``timing.png`` and
``throughput.png``. Older metric names (``timing/<section>_s``) and eval results with or without sets
plot alike; a directory with only ``eval.json`` gets ``eval.png``.
What each figure draws: docs/design-notes.md, "megamarl/runtime/plot.py".
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display (clusters, CI)
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from megamarl.runtime.metrics import read_eval, read_metrics

Series = dict[str, tuple[list[int], list[float]]]  # key -> (steps, values)

TIMING_ORDER = ("rollout", "logprob", "update", "weight_sync", "idle")
POLICY_PANELS = (
    ("loss", "loss"),
    ("pg_loss", "pg loss"),
    ("approx_kl", "KL to old policy"),
    ("kl_loss", "KL to reference"),
    ("entropy", "entropy (nats)"),
    ("clip_frac", "clipped token share"),
    ("grad_norm", "grad norm"),
    ("vf_loss", "value loss"),
)
AGENT_PANELS = (
    ("response_len", "response length (tokens)"),
    ("invalid_rate", "invalid share"),
    ("advantage_std", "advantage std"),
    ("response_clip_ratio", "clipped response share"),
)
GLOBAL_PANELS = (
    ("kl", "KL"),
    ("entropy", "entropy (nats)"),
    ("clip_frac", "clipped token share"),
    ("invalid_rate", "invalid share"),
)  # runs logged before per-policy loss metrics
RATE = re.compile(r"^(?:(?P<set>.+)/)?(?P<metric>team_accuracy|accuracy|avg@\d+|pass@\d+)$")
AGENT_PALETTE = "tab10"
# policies: Dark2 reordered so its first colours differ from tab10's blue and orange (agents)
POLICY_PALETTE = ("#7570b3", "#1b9e77", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")


class Colors:
    """name -> colour, fixed by the sorted names of the run so every figure agrees."""

    def __init__(self, names, palette: str | tuple[str, ...]) -> None:
        # a named qualitative palette is a ListedColormap, which has .colors
        colors = matplotlib.colormaps[palette].colors if isinstance(palette, str) else palette  # type: ignore[attr-defined]
        self._colors = {name: colors[i % len(colors)] for i, name in enumerate(sorted(set(names)))}

    def __getitem__(self, name: str):
        return self._colors[name]


def plot_run(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Draw every plot the run's logs support; return the written PNG paths."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    figures = run_figures(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out_dir / f"{name}.png") for name, fig in figures.items()]


def run_figures(run_dir: Path) -> dict:
    """name -> matplotlib Figure for everything ``run_dir``'s logs support."""
    has_metrics = (run_dir / "metrics.jsonl").is_file()
    evals = read_eval(run_dir)
    if not has_metrics and not evals:
        raise ValueError(f"{run_dir}: no metrics.jsonl or eval.json (is this a megamarl run directory?)")
    series = _series(read_metrics(run_dir)) if has_metrics else {}
    eval_series = _eval_series(evals)
    agents = Colors([*_names(series, "agent"), *_names(eval_series, "agent")], AGENT_PALETTE)
    policies = Colors(
        [
            *_names(series, "policy"),
            *_names(series, "perf/max_memory_gib", tail=False),
            *_names(eval_series, "policy"),
        ],
        POLICY_PALETTE,
    )
    title = run_dir.resolve().name
    draws = (
        ("rewards", lambda: _rewards(series, agents, policies, title)),
        ("timing", lambda: _timing(series, title)),
        ("training", lambda: _training(series, agents, policies, title)),
        ("throughput", lambda: _throughput(series, policies, title)),
        ("eval", lambda: _eval(eval_series, agents, policies, title)),
    )
    figures = {}
    for name, draw in draws:
        fig = draw()
        if fig is not None:
            figures[name] = fig
    return figures


# ---- reading ------------------------------------------------------------------------------------
def _series(records: list[dict]) -> Series:
    """metric -> (steps, values), skipping nulls (non-finite values)."""
    out: Series = defaultdict(lambda: ([], []))
    for record in records:
        for key, value in record.items():
            if key in ("step", "time", "elapsed_s") or not isinstance(value, (int, float)):
                continue
            out[key][0].append(record["step"])
            out[key][1].append(float(value))
    return dict(out)


def _eval_series(entries: list[dict]) -> Series:
    out: Series = defaultdict(lambda: ([], []))
    for entry in sorted(entries, key=lambda e: e["step"]):
        for key, value in entry["results"].items():
            if value is not None and key != "step":
                out[key.removeprefix("eval/")][0].append(entry["step"])
                out[key.removeprefix("eval/")][1].append(float(value))
    return dict(out)


def _per_name(series: Series, prefix: str, metric: str) -> Series:
    pattern = re.compile(rf"^{re.escape(prefix)}/([^/]+)/{re.escape(metric)}$")
    return {m.group(1): v for k, v in series.items() if (m := pattern.match(k))}


def _names(series: Series, prefix: str, *, tail: bool = True) -> set[str]:
    """Names in ``prefix/<name>/...`` keys (``tail=False``: ``prefix/<name>`` keys)."""
    pattern = re.compile(rf"^{re.escape(prefix)}/([^/]+)" + ("/" if tail else "$"))
    return {m.group(1) for k in series if (m := pattern.match(k))}


def _timing_sections(series: Series) -> Series:
    """Top-level sections: ``timing_s/<section>`` (not ``timing_s/<policy>/<section>``) and the older
    ``timing/<section>_s``."""
    out = {}
    for key, value in series.items():
        if (m := re.match(r"^timing_s/([^/]+)$", key)) or (m := re.match(r"^timing/([^/]+)_s$", key)):
            out[m.group(1)] = value
    return out


# ---- drawing --------------------------------------------------------------------------------------
def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(ax, steps, values, *, color, label: str, marker: str = "o") -> None:
    if len(values) > 20:  # raw points faint, moving average bold
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, _smooth(values, max(3, len(values) // 10)), color=color, linewidth=2, label=label)
    else:
        ax.plot(steps, values, color=color, linewidth=2, marker=marker, markersize=3, label=label)


def _curves(ax, curves: Series, colors: Colors, ylabel: str) -> None:
    for name, (steps, values) in sorted(curves.items()):
        _line(ax, steps, values, color=colors[name], label=name)
    _label(ax, ylabel)


def _label(ax, ylabel: str, *, legend: bool = True) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)


def _rewards(series: Series, agents: Colors, policies: Colors, title: str):
    rewards = _per_name(series, "agent", "reward_mean")
    if not rewards:
        return None
    success = _per_name(series, "agent", "success")
    policy_success = _per_name(series, "policy", "success")
    panels = 1 + bool(success) + (len(policy_success) > 1)
    axes: Any  # a numpy grid of Axes, then its first column as a list
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.4 * panels), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    # a +-std band: min/max of game outcomes are just the reward range (-1..1) at every step
    stds = _per_name(series, "agent", "reward_std")
    for agent in sorted(set(stds) & set(rewards)):
        steps, means = rewards[agent]
        spread = dict(zip(*stds[agent], strict=True))
        low = [m - spread.get(s, 0.0) for s, m in zip(steps, means, strict=True)]
        high = [m + spread.get(s, 0.0) for s, m in zip(steps, means, strict=True)]
        axes[0].fill_between(steps, low, high, color=agents[agent], alpha=0.12, linewidth=0)
    _curves(axes[0], rewards, agents, "shaped reward (mean; band: +-std)" if stds else "shaped reward (mean)")
    axes[0].set_title(f"{title}: reward per agent")
    if success:
        _curves(axes[1], success, agents, "own success rate")
        axes[1].set_ylim(-0.03, 1.03)
    if len(policy_success) > 1:
        _curves(axes[-1], policy_success, policies, "policy success rate")
        axes[-1].set_ylim(-0.03, 1.03)
    _bottom_xlabel(axes)
    return fig


def _bottom_xlabel(axes) -> None:
    """Stacked panels share the step axis: label it once, under the last."""
    for ax in axes[:-1]:
        ax.set_xlabel("")


def _timing(series: Series, title: str):
    parts = _timing_sections(series)
    total = parts.pop("step", None)
    if not parts:
        return None
    names = [n for n in TIMING_ORDER if n in parts] + sorted(n for n in parts if n not in TIMING_ORDER)
    steps = sorted({s for n in names for s in parts[n][0]})
    stacks = [[dict(zip(*parts[n], strict=True)).get(s, 0.0) for s in steps] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if len(steps) > 1:
        ax.stackplot(steps, stacks, labels=names, alpha=0.85)
    else:
        bottom = 0.0
        for name, stack in zip(names, stacks, strict=True):
            ax.bar(steps, stack, bottom=bottom, label=name)
            bottom += stack[0]
    if total is not None:
        ax.plot(total[0], total[1], color="black", linewidth=1.5, label="step (total)")
    ax.set_title(f"{title}: time per step")
    _label(ax, "seconds", legend=False)
    ax.legend(loc="upper left", fontsize=8, ncols=min(3, len(names) + 1))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the stack
    return fig


def _grid(panels: list, title: str, *, cols: int = 3):
    cols = min(cols, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.1 * rows), squeeze=False)
    for ax, draw in zip(
        axes.flat, panels, strict=False
    ):  # strict=False: the grid may have more axes than panels
        draw(ax)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    return fig


def _panel(curves: Series, colors: Colors | None, ylabel: str, name: str):
    def draw(ax):
        if colors is None:
            ((steps, values),) = curves.values()
            _line(ax, steps, values, color="tab:gray", label=name)
            _label(ax, ylabel, legend=False)
        else:
            _curves(ax, curves, colors, ylabel)
        ax.set_title(name, fontsize=10)

    return draw


def _training(series: Series, agents: Colors, policies: Colors, title: str):
    panels = [_panel({"": series[k]}, None, label, k) for k, label in GLOBAL_PANELS if k in series]
    for metric, label in POLICY_PANELS:
        if curves := _per_name(series, "policy", metric):
            panels.append(_panel(curves, policies, label, f"policy {metric}"))
    for metric, label in AGENT_PANELS:
        if curves := _per_name(series, "agent", metric):
            panels.append(_panel(curves, agents, label, f"agent {metric}"))
    return _grid(panels, f"{title}: training") if panels else None


def _throughput(series: Series, policies: Colors, title: str):
    tokens = {
        k.removeprefix("perf/").removesuffix("_per_s"): v
        for k, v in series.items()
        if k.startswith("perf/") and k.endswith("tokens_per_s")
    }
    samples = {k: v for k, v in series.items() if k == "perf/samples_per_s"}
    memory = {
        k.removeprefix("perf/max_memory_gib/"): v
        for k, v in series.items()
        if k.startswith("perf/max_memory_gib/")
    }
    panels = []
    if tokens:
        panels.append(_panel(tokens, Colors(tokens, "Set1"), "tokens / s", "token throughput"))
    if samples:
        panels.append(_panel(samples, None, "samples / s", "samples per second of step"))
    if memory:
        panels.append(_panel(memory, policies, "GiB", "peak memory per worker group"))
    return _grid(panels, f"{title}: throughput and memory") if panels else None


def _eval(series: Series, agents: Colors, policies: Colors, title: str):
    rates = {}
    for key, value in series.items():
        m = RATE.match(key)
        # avg@k equals team_accuracy whenever every task ran its k episodes, and pass@1 equals avg@1
        if m and not m.group("metric").startswith("avg@") and m.group("metric") != "pass@1":
            rates[(m.group("set") or "", m.group("metric"))] = value
    agent_success = _per_name(series, "agent", "success")
    if not rates and not agent_success:
        return None
    panels = int(bool(rates)) + int(bool(agent_success))
    axes: Any  # a numpy grid of Axes, then its first column as a list
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.8 * panels), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    if rates:
        ax = axes[0]
        many_sets = len({s for s, _ in rates}) > 1  # colour by set, marker by metric; else colour by metric
        colors = Colors([s if many_sets else m for s, m in rates], "Set1")
        markers = dict(
            zip(sorted({m for _, m in rates}), "os^Dv", strict=False)
        )  # strict=False: at most five metrics get a marker
        for (eval_set, metric), (steps, values) in sorted(rates.items()):
            color = colors[eval_set if many_sets else metric]
            name = "/".join(filter(None, (eval_set, metric)))
            _line(
                ax,
                steps,
                values,
                color=color,
                marker=markers[metric],
                label=f"{name}: {values[0]:.3g} -> {values[-1]:.3g}",
            )
            ax.axhline(values[0], color=color, linestyle="--", linewidth=1, alpha=0.6)
        first = min(s for steps, _ in rates.values() for s in steps)
        ax.set_title(f"{title}: held-out evaluation (dashed: base model, step {first})")
        _label(ax, "success rate")
        ax.set_ylim(-0.03, 1.03)
    if agent_success:
        ax = axes[-1]
        for agent, (steps, values) in sorted(agent_success.items()):
            _line(
                ax, steps, values, color=agents[agent], label=f"{agent}: {values[0]:.3g} -> {values[-1]:.3g}"
            )
            ax.axhline(values[0], color=agents[agent], linestyle="--", linewidth=1, alpha=0.6)
        ax.set_title("held-out own success per agent (dashed: base model)")
        _label(ax, "own success rate")
        ax.set_ylim(-0.03, 1.03)
    _bottom_xlabel(axes)
    return fig


def _save(fig, path: Path) -> Path:
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a megamarl run's metrics.jsonl / eval.json to PNGs.")
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl and/or eval.json")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)


if __name__ == "__main__":
    main()
