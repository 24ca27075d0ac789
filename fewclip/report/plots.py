"""The report's figures: accuracy against shots, and cost against accuracy."""
from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fewclip.report.runs import AVERAGE, ZEROSHOT
from fewclip.report.stats import CellStats, CostStats
from fewclip.utils.io import atomic_write

logger = logging.getLogger(__name__)


# Figure


# fewclip's own methods in a fixed order (new names go at the end, never in between): each keeps its colour in
# every figure of every report, whichever other methods are beside it; any other name gets one from its hash.
KNOWN_METHODS = ("coop", "linear_probe", "tip_adapter", "tip_adapter_f", "lora", "cocoop", "zs_probe", "lpp",
                 "clip_adapter", "maple", "kgcoop", "prograd", "promptsrc", "taskres", "clap", "gda", "proker",
                 "prolip", "ivlp", "dept", "tcp", "coprompt", "mmrl", "skiptuning", "clip_svd", "twosfs")
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5",
            "#dbdb8d", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")
MAJORITY_STYLE = {"ls": ":", "lw": 1.2, "color": "0.45"}
CHANCE_STYLE = {"ls": "-.", "lw": 1.0, "color": "0.65"}
METRICS = (("mean", "ci95", "top-1 accuracy (%)"),
           ("mean_per_class", "mean_per_class_ci95", "mean per-class accuracy (%)"))


def method_colour(method: str, names: Mapping[str, str] | None = None) -> str:
    """The colour of ``method``: decided by its name alone (``KNOWN_METHODS``' order, else a hash of the name),
    so adding or dropping other methods never changes it; ``names``: a shown name -> the method's own name (a
    report's ``rename``), so renaming does not either."""
    method = (names or {}).get(method, method)
    if method in KNOWN_METHODS:
        return _PALETTE[KNOWN_METHODS.index(method) % len(_PALETTE)]
    return _PALETTE[zlib.crc32(method.encode("utf-8")) % len(_PALETTE)]


def _metrics(cells: Sequence[CellStats]) -> list[tuple[str, str, str]]:
    """Top-1, and the mean per-class accuracy where the runs record it."""
    return [m for m in METRICS if m[0] == "mean" or any(c.mean_per_class is not None for c in cells)]


def _lines(ax, cells: Sequence[CellStats], key: str, handles: dict) -> None:
    """The lines without learning: the majority class (top-1 only; its mean per-class accuracy is chance) and
    uniform chance, where the runs record them (averaged over the cells' datasets on an average panel)."""
    majority = [c.majority for c in cells if c.majority is not None]
    chance = [c.chance for c in cells if c.chance is not None]
    if key == "mean" and majority:
        handles.setdefault("majority class", ax.axhline(sum(majority) / len(majority), **MAJORITY_STYLE))
    if chance:
        handles.setdefault("uniform chance", ax.axhline(sum(chance) / len(chance), **CHANCE_STYLE))


def _draw(ax, here: Sequence[CellStats], methods: Sequence[str], key: str, ci_key: str, handles: dict,
          names: Mapping[str, str] | None = None) -> None:
    """One panel: 0-shot methods as horizontal lines, the others against shots with their 95% bars."""
    for c in here:
        if c.shots == 0 and getattr(c, key) is not None:  # zero-shot (or any 0-shot method): a horizontal line
            is_zs = c.method == ZEROSHOT
            h = ax.axhline(getattr(c, key), ls="--", lw=1.2, color="0.3" if is_zs else method_colour(c.method, names))
            handles.setdefault("zero-shot" if is_zs else f"{c.method} (0-shot)", h)
    for i, m in enumerate(methods):
        pts = sorted((c for c in here if c.method == m and c.shots > 0 and getattr(c, key) is not None),
                     key=lambda c: c.shots)
        if not pts:
            continue
        # Nudge methods apart along log2(x) so overlapping error bars stay readable.
        dodge = 2 ** (0.05 * (i - (len(methods) - 1) / 2))
        x = [c.shots * dodge for c in pts]
        y = [getattr(c, key) for c in pts]
        h = ax.errorbar(x, y, yerr=clipped_yerr(pts, key, ci_key), color=method_colour(m, names), marker="o", ms=4,
                        lw=1.5, capsize=3)
        handles.setdefault(m, h)
        partial = [(xi, yi) for xi, yi, c in zip(x, y, pts) if not c.complete]
        if partial:  # averages over only some datasets: hollow markers
            ax.plot(*zip(*partial), ls="none", marker="o", ms=6, mfc="white", mec=method_colour(m, names), zorder=3)
            handles.setdefault("average over only some datasets", ax.plot(
                [], [], ls="none", marker="o", ms=6, mfc="white", mec="0.3")[0])
    _lines(ax, [c for c in here if not c.is_average], key, handles)


def _one_per_dataset(cells: Sequence[CellStats]) -> list[CellStats]:
    """A cell per dataset that knows its lines (majority class, chance), for lines averaged over datasets."""
    first: dict[str, CellStats] = {}
    for c in cells:
        if not c.is_average and (c.majority is not None or c.chance is not None):
            first.setdefault(c.dataset, c)
    return list(first.values())


def _shots_axis(ax, xs: Sequence[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    if xs:
        ax.set_xticks(xs, [str(s) for s in xs])
        ax.set_xlim(xs[0] / 1.5, xs[-1] * 1.5)
    else:
        ax.set_xticks([])
        ax.set_xlim(1, 16)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("shots per class")


def plot_accuracy_vs_shots(cells: Sequence[CellStats], backbone: str, names: Mapping[str, str] | None = None):
    """CoOp-style figure for one backbone: a panel per dataset (+ average), a row of them for top-1 and one for
    the mean per-class accuracy (where the runs record it), with the majority-class and chance lines.

    Returns a ``matplotlib.figure.Figure`` built without pyplot, so no GUI
    backend is touched.
    """
    from matplotlib.figure import Figure  # matplotlib on the first plot: a start-up cost for every command otherwise

    cells = [c for c in cells if c.backbone == backbone]
    datasets = sorted({c.dataset for c in cells if not c.is_average})
    panels = datasets + ([AVERAGE] if len(datasets) > 1 else [])
    methods = sorted({c.method for c in cells if c.method != ZEROSHOT})
    xs = sorted({c.shots for c in cells if c.shots > 0})
    metrics = _metrics(cells)

    ncols = min(4, len(panels))
    per = math.ceil(len(panels) / ncols)  # rows of panels per metric
    fig = Figure(figsize=(3.6 * ncols, 3.0 * per * len(metrics)), layout="constrained")
    axes = fig.subplots(per * len(metrics), ncols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for k, (key, ci_key, ylabel) in enumerate(metrics):
        block = axes[k * per * ncols:(k + 1) * per * ncols]
        for ax, ds in zip(block, panels):
            _draw(ax, [c for c in cells if c.dataset == ds], methods, key, ci_key, handles, names)
            if ds == AVERAGE:  # the lines averaged over the datasets
                _lines(ax, _one_per_dataset(cells), key, handles)
            _shots_axis(ax, xs)
            ax.set_title("Average over datasets" if ds == AVERAGE else ds, fontsize=10)
            ax.set_ylabel(ylabel)
        for ax in block[len(panels):]:
            ax.set_visible(False)
    fig.suptitle(f"Accuracy vs. shots: {backbone} (bars: t-based 95% CI over seeds, clipped to 0-100%)",
                 fontsize=11)
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5), frameon=False, fontsize=9)
    return fig


def plot_backbones(cells: Sequence[CellStats], names: Mapping[str, str] | None = None):
    """Every backbone side by side (a column each; rows: top-1 and mean per-class accuracy): each backbone's
    average over datasets, or its one dataset. Method colours as in every other figure (``method_colour``)."""
    from matplotlib.figure import Figure

    backbones = sorted({c.backbone for c in cells})
    methods = sorted({c.method for c in cells if c.method != ZEROSHOT})
    xs = sorted({c.shots for c in cells if c.shots > 0})
    metrics = _metrics(cells)
    fig = Figure(figsize=(3.6 * len(backbones), 3.0 * len(metrics)), layout="constrained")
    axes = fig.subplots(len(metrics), len(backbones), squeeze=False)
    handles: dict[str, Any] = {}
    for j, bb in enumerate(backbones):
        mine = [c for c in cells if c.backbone == bb]
        datasets = sorted({c.dataset for c in mine if not c.is_average})
        shown = [c for c in mine if c.is_average] if len(datasets) > 1 else [c for c in mine if not c.is_average]
        for i, (key, ci_key, ylabel) in enumerate(metrics):
            ax = axes[i][j]
            _draw(ax, shown, methods, key, ci_key, handles, names)
            if len(datasets) > 1:
                _lines(ax, _one_per_dataset(mine), key, handles)
            _shots_axis(ax, xs)
            ax.set_title(f"{bb}: " + (f"average over {len(datasets)} datasets" if len(datasets) > 1
                                      else datasets[0]), fontsize=10)
            ax.set_ylabel(ylabel)
    fig.suptitle("Accuracy vs. shots, every backbone (bars: t-based 95% CI over seeds, clipped to 0-100%; one "
                 "figure per backbone beside this one)", fontsize=11)
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5), frameon=False, fontsize=9)
    return fig


def plot_cost_vs_accuracy(costs: Sequence[CostStats], backbone: str, names: Mapping[str, str] | None = None):
    """Average top-1 against training time and against images encoded for one backbone: a point per (method,
    shots), a line through each method's shots; methods that train nothing (0 shots) are a dashed line.
    Returns a ``matplotlib.figure.Figure`` built without pyplot."""
    from matplotlib.figure import Figure  # matplotlib on the first plot: a start-up cost for every command otherwise

    costs = [c for c in costs if c.backbone == backbone and c.top1 is not None]
    methods = sorted({c.method for c in costs if c.shots > 0})
    color = {m: method_colour(m, names) for m in methods}
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


def clipped_yerr(cells: Sequence[CellStats], key: str = "mean", ci_key: str = "ci95") -> list[list[float]]:
    """Error bars [[below], [above]]: each cell's 95% half-width, clipped so that no bar leaves 0-100% (with 3
    seeds a half-width is 4.3 standard deviations: unclipped bars run past the axis's meaning)."""
    below = [min(getattr(c, ci_key) or 0.0, max(getattr(c, key), 0.0)) for c in cells]
    above = [min(getattr(c, ci_key) or 0.0, max(100.0 - getattr(c, key), 0.0)) for c in cells]
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
