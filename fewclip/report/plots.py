"""The report's figures: accuracy against shots, and cost against accuracy."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Sequence

from fewclip.utils.io import atomic_write

from fewclip.report.runs import AVERAGE, ZEROSHOT
from fewclip.report.stats import CellStats, CostStats

logger = logging.getLogger(__name__)


# Figure


def plot_accuracy_vs_shots(cells: Sequence[CellStats], backbone: str):
    """CoOp-style figure for one backbone: a panel per dataset (+ average).

    Returns a ``matplotlib.figure.Figure`` built without pyplot, so no GUI
    backend is touched.
    """
    from matplotlib import colormaps  # matplotlib on the first plot: a start-up cost for every command otherwise
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    cells = [c for c in cells if c.backbone == backbone]
    datasets = sorted({c.dataset for c in cells if not c.is_average})
    panels = datasets + ([AVERAGE] if len(datasets) > 1 else [])
    methods = sorted({c.method for c in cells if c.method != ZEROSHOT})
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    color = {m: cmap(i % cmap.N) for i, m in enumerate(methods)}
    xs = sorted({c.shots for c in cells if c.shots > 0})

    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(3.6 * ncols, 3.0 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, ds in zip(axes, panels):
        here = [c for c in cells if c.dataset == ds]
        for c in here:
            if c.shots == 0:  # zero-shot (or any 0-shot method): a horizontal line
                is_zs = c.method == ZEROSHOT
                h = ax.axhline(c.mean, ls="--", lw=1.2, color="0.3" if is_zs else color[c.method])
                handles.setdefault("zero-shot" if is_zs else f"{c.method} (0-shot)", h)
        for i, m in enumerate(methods):
            pts = sorted((c for c in here if c.method == m and c.shots > 0), key=lambda c: c.shots)
            if not pts:
                continue
            # Nudge methods apart along log2(x) so overlapping error bars stay readable.
            dodge = 2 ** (0.05 * (i - (len(methods) - 1) / 2))
            x = [c.shots * dodge for c in pts]
            h = ax.errorbar(x, [c.mean for c in pts], yerr=clipped_yerr(pts),
                            color=color[m], marker="o", ms=4, lw=1.5, capsize=3)
            handles.setdefault(m, h)
            partial = [(xi, c.mean) for xi, c in zip(x, pts) if not c.complete]
            if partial:  # averages over only some datasets: hollow markers
                ax.plot(*zip(*partial), ls="none", marker="o", ms=6, mfc="white", mec=color[m], zorder=3)
                handles.setdefault("average over only some datasets", ax.plot(
                    [], [], ls="none", marker="o", ms=6, mfc="white", mec="0.3")[0])
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        if xs:
            ax.set_xticks(xs, [str(s) for s in xs])
            ax.set_xlim(xs[0] / 1.5, xs[-1] * 1.5)
        else:
            ax.set_xticks([])
            ax.set_xlim(1, 16)
        ax.set_title("Average over datasets" if ds == AVERAGE else ds, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("shots per class")
        ax.set_ylabel("top-1 accuracy (%)")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Accuracy vs. shots: {backbone} (bars: t-based 95% CI over seeds, clipped to 0-100%)",
                 fontsize=11)
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5), frameon=False, fontsize=9)
    return fig


def plot_cost_vs_accuracy(costs: Sequence[CostStats], backbone: str):
    """Average top-1 against training time and against images encoded for one backbone: a point per (method,
    shots), a line through each method's shots; methods that train nothing (0 shots) are a dashed line.
    Returns a ``matplotlib.figure.Figure`` built without pyplot."""
    from matplotlib import colormaps  # matplotlib on the first plot: a start-up cost for every command otherwise
    from matplotlib.figure import Figure

    costs = [c for c in costs if c.backbone == backbone and c.top1 is not None]
    methods = sorted({c.method for c in costs if c.shots > 0})
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    color = {m: cmap(i % cmap.N) for i, m in enumerate(methods)}
    fig = Figure(figsize=(9.0, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, key, label in zip(axes, ("train_time_s", "images_encoded"),
                              ("training time per run (s)", "images encoded per run")):
        for c in costs:
            if c.shots == 0:
                h = ax.axhline(c.top1, ls="--", lw=1.2, color="0.3" if c.method == ZEROSHOT else "0.6")
                handles.setdefault("zero-shot" if c.method == ZEROSHOT else f"{c.method} (0-shot)", h)
        for m in methods:
            pts = sorted((c for c in costs if c.method == m and c.shots > 0 and (getattr(c, key) or 0) > 0),
                         key=lambda c: c.shots)
            if not pts:
                continue
            x, y = [getattr(c, key) for c in pts], [c.top1 for c in pts]
            h = ax.plot(x, y, marker="o", ms=4, lw=1.2, color=color[m])[0]
            handles.setdefault(m, h)
            for xi, yi, c in zip(x, y, pts):
                ax.annotate(str(c.shots), (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7,
                            color=color[m])
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("top-1 accuracy (%), average")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Cost vs. accuracy: {backbone} (numbers: shots)", fontsize=11)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(len(handles), 5), frameon=False, fontsize=9)
    return fig


FORMATS = ("png", "pdf", "svg")


def clipped_yerr(cells: Sequence[CellStats]) -> list[list[float]]:
    """Error bars [[below], [above]]: each cell's 95% half-width, clipped so that no bar leaves 0-100% (with 3
    seeds a half-width is 4.3 standard deviations: unclipped bars run past the axis's meaning)."""
    below = [min(c.ci95 or 0.0, max(c.mean, 0.0)) for c in cells]
    above = [min(c.ci95 or 0.0, max(100.0 - c.mean, 0.0)) for c in cells]
    return [below, above]


def save_figure(fig, path: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Write ``fig`` at ``path`` with each of ``formats``'s suffix (png at 200 dpi; pdf and svg are vector)."""
    out = []
    for fmt in formats:
        target = path.with_suffix(f".{fmt}")
        out.append(atomic_write(target, lambda tmp, fmt=fmt: fig.savefig(tmp, format=fmt, dpi=200,
                                                                        bbox_inches="tight")))
    return out


def _save_figure(fig, path: Path) -> Path:
    return save_figure(fig, path)[0]


# ----------------------------------------------------------------------------
