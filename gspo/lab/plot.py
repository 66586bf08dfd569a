"""Plot metrics of one or more runs against the training step.

    gspo plot runs/gspo runs/grpo --metrics reward/mean,clip/frac --output compare.png
    from gspo.lab.plot import plot_runs; plot_runs(["runs/gspo"], ["reward/mean"], "out.png")

One panel per metric, one line per run (labelled by its directory name). Metrics whose name
starts with `clip/` or `kl/` get a log y-axis by default, as in the paper's Figure 2;
`--smooth N` draws a trailing moving average over N steps (of training metrics: held-out
evaluations, a few points each, are drawn as they are). Held-out evaluations from
`summary.json` are drawn as `eval/accuracy` when that metric is asked for.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from gspo.io.files import read_jsonl


class PlotError(ValueError):
    pass


def load_series(run_dir: Path, metric: str) -> tuple[list[int], list[float]]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    xs, ys = [], []
    for r in rows:
        v = r.get(metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    if metric == "eval/accuracy" and (run_dir / "summary.json").exists():
        evals = json.loads((run_dir / "summary.json").read_text()).get("evals", [])
        pts = {e["step"]: e["accuracy"] for e in evals if e.get("accuracy") is not None}
        pts.update(dict(zip(xs, ys)))
        xs, ys = sorted(pts), [pts[s] for s in sorted(pts)]
    return xs, ys


def smooth(ys: list[float], n: int) -> list[float]:
    """Trailing moving average over n points.

    >>> smooth([1.0, 2.0, 3.0, 4.0], 2)
    [1.0, 1.5, 2.5, 3.5]
    """
    if n <= 1:
        return ys
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= n:
            acc -= ys[i - n]
        out.append(acc / min(i + 1, n))
    return out


# held-out evaluations are a handful of points, not a noisy per-step series: never smoothed
NOT_SMOOTHED = ("eval/accuracy", "held-out accuracy")


def plot_panels(panels: dict[str, dict[str, tuple[list, list]]], output: str | Path, *, smooth_n: int = 1,
                log_y: list[str] | None = None, title: str | None = None, xlabel: str = "step") -> Path:
    """One panel per metric: {metric: {label: (steps, values)}}; written atomically as PNG."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    log_y = [m for m in panels if m.startswith(("clip/", "kl/"))] if log_y is None else log_y
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), squeeze=False, sharex=True)
    for ax, (metric, lines) in zip(axes[:, 0], panels.items()):
        n = 1 if metric in NOT_SMOOTHED else smooth_n
        for label, (xs, ys) in lines.items():
            if xs:
                ax.plot(xs, smooth(ys, n), label=label, marker="o" if len(xs) < 12 or n == 1 and
                        metric in NOT_SMOOTHED else None, ms=3)
        ax.set_ylabel(metric)
        if metric in log_y and any(y > 0 for _, ys in lines.values() for y in ys):
            ax.set_yscale("log")
        elif metric in log_y:
            ax.text(0.5, 0.5, "all values are 0: nothing to draw on a log scale", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and lengths are whole numbers
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(xlabel)
    n = max(len(lines) for lines in panels.values())
    if n > 12:  # a study's dozens of configurations: the legend in columns beside the panels
        cols = math.ceil(n / 24)
        fig.set_size_inches(7 + 2.4 * cols, max(2.6 * len(panels), 5.5))
        axes[0, 0].legend(fontsize=6, ncol=cols, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, Path(output))


def plot_levels(series: dict[str, list[tuple[float | None, float | None]]], levels: list[str], output: str | Path, *,
                labels: tuple[str, str], log_y: bool = False) -> Path:
    """One figure against a factor's levels (evenly spaced, labelled): a line per configuration,
    {label: [(mean, half-width of its 95% interval or None) per level]}, the intervals as error
    bars; labels: the x axis's label and the figure's title. Written atomically as PNG."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    step = min(0.04, 0.5 / len(series))  # the configurations side by side at each level
    for i, (label, points) in enumerate(series.items()):
        xs = [j + step * (i - len(series) / 2) for j, (m, _) in enumerate(points) if m is not None]
        ys = [m for m, _ in points if m is not None]
        errs = [h or 0.0 for m, h in points if m is not None]
        if xs:  # past the 10 colours of the cycle, dashed lines
            ax.errorbar(xs, ys, yerr=errs, label=label, marker="o", ms=4, capsize=3, ls="-" if i < 10 else "--")
    if log_y and any(m for points in series.values() for m, _ in points):
        ax.set_yscale("log")
    ax.set_xticks(range(len(levels)), levels)
    ax.set_xlabel(labels[0])
    ax.set_title(labels[1], fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return _save(fig, Path(output))


def _pyplot():
    """matplotlib.pyplot on its file-only backend (a PlotError naming the extra without it)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install 'gspo[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.stem}.tmp{output.suffix}")
    fig.savefig(tmp, dpi=110)
    _pyplot().close(fig)
    os.replace(tmp, output)
    return output


def plot_runs(run_dirs: list[str | Path], metrics: list[str], output: str | Path, *, smooth_n: int = 1,
              log_y: list[str] | None = None, title: str | None = None) -> Path:
    runs = [Path(d) for d in run_dirs]
    for d in runs:
        if not (d / "metrics.jsonl").exists():
            raise PlotError(f"{d}: no metrics.jsonl; not a gspo run directory")
    if not metrics:
        raise PlotError("no metrics to plot; pass --metrics reward/mean,clip/frac")
    available = {"eval/accuracy"} | {k for d in runs for row in read_jsonl(d / "metrics.jsonl") for k in row} - {"step"}
    unknown = [m for m in metrics if m not in available]
    if unknown:
        raise PlotError(f"--metrics: {', '.join(unknown)} not logged by these runs; available: "
                        f"{', '.join(sorted(available))}")
    panels = {m: {d.name: load_series(d, m) for d in runs} for m in metrics}
    if not any(xs for lines in panels.values() for xs, _ in lines.values()):
        raise PlotError(f"none of the runs logged {', '.join(metrics)}")
    return plot_panels(panels, output, smooth_n=smooth_n, log_y=log_y, title=title)
