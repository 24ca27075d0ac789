"""Summarise a tree of finished runs into tables and an accuracy-vs-shots figure.

``fewclip report DIR`` calls :func:`write_report`. Every directory under ``DIR``
that holds a ``metrics.json`` is one run::

    {"method": "coop", "dataset": "toy-shapes", "backbone": "toy-clip",
     "shots": 16, "seed": 1, "top1": 83.25, ...}

Runs are grouped into cells by (backbone, dataset, method, shots) and each cell
is summarised over its seeds. The zero-shot baseline is the method
``"zeroshot"`` at 0 shots.

Conventions (also stated in ``report.md``):

* ``std`` is the sample standard deviation (ddof=1) and ``ci95`` the half-width
  of the 95% confidence interval of the mean, ``t(0.975, n-1) * std / sqrt(n)``.
  With one seed both are undefined: they are ``None`` here, empty in
  ``report.csv``, ``null`` in ``report.json``, left out of ``report.md`` and
  drawn without an error bar. No output ever holds NaN.
* An average row (``dataset == "average"``) is the plain mean of the
  per-dataset means over the datasets that have that cell; its ``n`` counts
  those datasets, ``datasets`` names them, ``complete`` says whether every
  dataset of that backbone is included (``report.md`` marks the others with
  a dagger and lists what is missing). Its ``std``/``ci95`` are ``None``:
  spread over datasets is not a confidence interval of anything. With a
  single dataset ``report.md`` leaves the (identical) average rows out.
* ``delta_zeroshot`` is the cell mean minus the zero-shot mean (over its
  seeds) of the same backbone and dataset, in accuracy points; ``None`` when
  that dataset has no zero-shot run. On an average row it is the mean of the
  per-dataset deltas, given only when every averaged dataset has a zero-shot
  run (otherwise it would compare different sets of datasets).
* Figures: ``accuracy_vs_shots.png`` shows the backbone, one panel per dataset
  plus an "Average" panel when there are two or more datasets (a hollow marker
  is an average over only some datasets), a row of panels for top-1 and one for
  the mean per-class accuracy, with the majority-class and uniform-chance lines.
  With several backbones, it shows every backbone side by side (each one's
  average over datasets), and ``accuracy_vs_shots_<backbone>.png`` is written
  for each of them, and ``report.md`` links those. A method has the same
  colour in every figure: its name decides it (``plots.method_colour``).
* Mean per-class accuracy (balanced accuracy) beside top-1 in every output,
  and the majority-class and uniform-chance lines (``report.md``'s "Without
  learning" table): on an imbalanced test set, top-1 alone rewards favouring
  the largest class.
* A sweep's folder holds its plan (``sweep_plan.json``, ``fewclip.report.plan``):
  the report accounts for every planned run (finished, failed with the first
  line of its error, missing), shows ``n/N`` in a cell where fewer than planned
  finished, and marks (§) cells holding runs of another config than the plan's.
  A run whose ``metrics.json`` has no run record is marked (◊).
* Published results (``fewclip.report.published``): where runs match the setting of a published result
  (``fewclip published``), ``report.md`` gets a "Published results" section and ``published.csv`` is written:
  the runs' mean, the published value and the gap in standard errors of the seeds.
* Cost (runs whose ``metrics.json`` records it, ``fewclip.training.cost``): per
  backbone, a table of (method, shots) with the mean over that backbone's runs
  (every dataset and seed) of trainable parameters, training time, wall time,
  images encoded and peak memory (the CUDA allocator's peak for runs on a GPU,
  the process's peak resident memory otherwise), beside the average top-1 of
  the accuracy table; ``cost_vs_accuracy.png`` (and
  ``cost_vs_accuracy_<backbone>.png`` with several backbones) plots that top-1
  against training time and against images encoded.

Generalisation protocols (runs whose ``metrics.json`` has ``protocol`` other
than ``fewshot`` and ``evals`` per test set, ``fewclip.training.evals``) get a table per
protocol and backbone instead of the few-shot tables and figures:

* ``base2new``, CoCoOp's Table 1: per dataset and method, Base, New (each the
  mean over seeds ± 95% CI) and H, the harmonic mean of the two seed means;
  with two or more datasets an average block first, whose Base and New are the
  means over datasets and whose H is that of those two averages
  (``fewclip.data.protocols.base2new_table``);
* ``cross_dataset`` and ``domain_shift``, CoCoOp's Tables 2 and 3: per source
  dataset, a row per method with the source, each target and the average over
  the targets (of the seed means).

A test set that a method cannot score (new classes for a per-class classifier)
is "n/a", never a number; H and averages that need it are "n/a" too. A
zero-shot run of the same protocol gives each cell a ``delta_zeroshot``.
``report.csv`` and ``report.json`` carry every cell with its ``protocol`` and
``eval`` (``all`` for the few-shot protocol; ``base``, ``new``, ``hm``;
``source``, a target's name, ``average``). A run directory may hold several
protocols (``fewclip sweep`` puts each under ``OUT/<protocol>/``): each gets
its tables. The cost table and the figures cover the few-shot runs.

A malformed ``metrics.json`` (deeply nested JSON, numbers no run has) is skipped with a warning naming it,
and so is one whose finished-run record (``fewclip.runs.records``) no longer matches its files; symlinked run
folders are followed (each real folder once); of several
runs with the same (protocol, method, dataset, backbone, shots, seed), the first in
sorted path order is kept and the others are skipped with a warning.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fewclip.config.report import ReportOptions
from fewclip.report.html import write_html
from fewclip.report.latex import render_latex
from fewclip.report.plan import PlannedRun, account, plan_folders, plan_json, read_plan
from fewclip.report.plots import plot_accuracy_vs_shots, plot_backbones, plot_cost_vs_accuracy, save_figure
from fewclip.report.published import Comparison, compare, render_published_csv, render_published_markdown
from fewclip.report.runs import COST_FIGURE_FILE, FEWSHOT, FIGURE_FILE, METRICS_FILE, NoRunsFoundError, RunResult, SkippedFile, load_runs
from fewclip.report.stats import CellStats, CostStats, ProtocolCell, aggregate, aggregate_protocols, cost_stats, summarize, t_critical_975
from fewclip.report.tables import figure_names, render_csv, render_markdown, to_json
from fewclip.utils.io import atomic_write_json, atomic_write_text

__all__ = ["CellStats", "CostStats", "NoRunsFoundError", "ProtocolCell", "Report", "ReportOptions", "RunResult",
           "SkippedFile", "render_latex", "select",
           "aggregate", "aggregate_protocols", "build_report", "cost_stats", "load_runs", "plot_accuracy_vs_shots",
           "plot_cost_vs_accuracy", "render_csv", "render_markdown", "summarize", "t_critical_975", "to_json",
           "write_report"]

logger = logging.getLogger(__name__)


@dataclass
class Report:
    run_root: Path
    runs: list[RunResult]
    cells: list[CellStats]
    skipped: list[SkippedFile]
    markdown: str
    paths: dict[str, Path] = field(default_factory=dict)
    costs: list[CostStats] = field(default_factory=list)
    protocol_cells: list[ProtocolCell] = field(default_factory=list)
    published: list[Comparison] = field(default_factory=list)  # runs beside the published results they match
    planned: list[PlannedRun] = field(default_factory=list)  # a sweep plan's runs and what became of each
    colour_names: dict[str, str] = field(default_factory=dict)  # a renamed method -> the name deciding its colour

    @property
    def backbones(self) -> list[str]:
        return sorted({c.backbone for c in self.cells})

    def cell(self, backbone: str, dataset: str, method: str, shots: int) -> CellStats:
        for c in self.cells:
            if (c.backbone, c.dataset, c.method, c.shots) == (backbone, dataset, method, shots):
                return c
        raise KeyError((backbone, dataset, method, shots))

    def protocol_cell(self, protocol: str, backbone: str, dataset: str, method: str, shots: int,
                      eval: str) -> ProtocolCell:
        key = (protocol, backbone, dataset, method, shots, eval)
        for c in self.protocol_cells:
            if (c.protocol, c.backbone, c.dataset, c.method, c.shots, c.eval) == key:
                return c
        raise KeyError(key)


# Entry points


def with_plan(cells: list[CellStats], planned: Sequence[PlannedRun]) -> list[CellStats]:
    """The few-shot cells with the sweep plan's account of each (planned, failed, missing); a transductive row
    (``method+name``) is accounted as its method's runs."""
    if not planned:
        return cells
    by_cell: dict[tuple, list[PlannedRun]] = {}
    for p in planned:
        if p.protocol == FEWSHOT:
            by_cell.setdefault((p.backbone, p.dataset, p.method, p.shots), []).append(p)
    out = []
    for c in cells:
        ps = by_cell.get((c.backbone, c.dataset, c.method.split("+", 1)[0], c.shots))
        if c.is_average or not ps:
            out.append(c)
            continue
        out.append(dataclasses.replace(
            c, planned=len(ps), missing=sum(p.status == "missing" for p in ps),
            failed=tuple(f"seed {p.seed}: {p.error}" for p in ps if p.status == "failed")))
    return out


def renamed_method(method: str, rename: dict) -> str:
    """``method`` as ``rename`` names it (a transductive row ``method+name`` follows its method)."""
    head, plus, tail = method.partition("+")
    return rename.get(method) or (rename.get(head, head) + plus + tail)


def select(runs: list, options: ReportOptions) -> list:
    """The runs the options keep (methods, backbones, datasets, shots), renamed as they ask."""
    keep = []
    for r in runs:
        base = r.method.split("+", 1)[0]  # a transductive row (method+transclip) follows its method
        if options.methods and r.method not in options.methods and base not in options.methods:
            continue
        if options.backbones and r.backbone not in options.backbones:
            continue
        if options.datasets and r.dataset not in options.datasets:
            continue
        if options.shots and r.shots not in options.shots and r.shots != 0:
            continue
        keep.append(r)
    if options.rename:
        keep = [dataclasses.replace(r, method=renamed_method(r.method, options.rename)) for r in keep]
    return keep


def build_report(run_root: str | Path | Sequence[str | Path], options: ReportOptions | None = None) -> Report:
    """Read and aggregate the runs under ``run_root`` (one folder, or several merged: a run found in two is
    taken from the first, with a warning); ``options`` chooses and renames what is shown. Writes nothing."""
    options = options or ReportOptions()
    roots = [Path(run_root)] if isinstance(run_root, (str, Path)) else [Path(r) for r in run_root]
    run_root = roots[0]
    runs, skipped, seen, planned = [], [], {}, []
    for root in roots:
        got, bad = load_runs(root)
        skipped += bad
        for folder in plan_folders(root):  # a sweep's folder: account for every planned run
            plan = read_plan(folder)
            if plan is not None:
                got, accounted = account(folder, got, plan)
                planned += accounted
        for r in got:
            key = (r.protocol, r.method, r.dataset, r.backbone, r.shots, r.seed)
            if key in seen:
                logger.warning("%s: the run %s is also in %s; the report takes the first", root, key, seen[key])
                continue
            seen[key] = root
            runs.append(r)
    # a renamed method keeps the colour of its own name (plots.method_colour), so renaming changes no colour
    colour_names = {renamed_method(r.method, options.rename): r.method for r in runs} if options.rename else {}
    runs = select(runs, options)
    planned = select(planned, options)
    if not runs and not planned:  # a sweep whose every run failed still gets its account
        detail = (f"; {len(skipped)} {METRICS_FILE} file(s) were skipped as unusable, see the warnings"
                  if skipped else "")
        raise NoRunsFoundError(
            f"no runs found under {str(run_root)!r}: expected run directories holding a {METRICS_FILE} "
            f"with method, dataset, backbone, shots, seed and top1{detail}"
        )
    fewshot = [r for r in runs if r.protocol == FEWSHOT]
    cells = with_plan(aggregate(fewshot), planned)
    costs = cost_stats(fewshot, cells)
    protocol_cells = aggregate_protocols(runs)
    published = compare(runs, options.rename) if options.published else []
    markdown = render_markdown(roots if len(roots) > 1 else run_root, runs, cells, skipped, costs, protocol_cells,
                               planned=planned)
    if published:
        markdown += "\n" + render_published_markdown(published)
    return Report(run_root=run_root, runs=runs, cells=cells, skipped=skipped, markdown=markdown, costs=costs,
                  protocol_cells=protocol_cells, published=published, planned=planned, colour_names=colour_names)


def write_report(run_root: str | Path | Sequence[str | Path], out_dir: str | Path | None = None,
                 options: ReportOptions | None = None) -> Report:
    """Build the report and write report.md/.csv/.json, the figure(s) and report.html to ``out_dir``.

    ``out_dir`` defaults to ``run_root``. Returns the :class:`Report`, whose
    ``markdown`` the CLI prints and whose ``paths`` name the files written.
    """
    options = options or ReportOptions()
    report = build_report(run_root, options)
    out = Path(out_dir or options.out or report.run_root)
    out.mkdir(parents=True, exist_ok=True)
    formats = list(options.format)
    paths = {
        "md": atomic_write_text(out / "report.md", report.markdown),
        "csv": atomic_write_text(out / "report.csv", render_csv(report.cells, report.protocol_cells)),
        "json": atomic_write_json(out / "report.json",
                                  {**to_json(report.run_root, report.runs, report.cells, report.skipped, report.costs,
                                             report.protocol_cells),
                                   **({"planned_runs": plan_json(report.planned)} if report.planned else {})}),
    }
    if report.published:
        paths["published_csv"] = atomic_write_text(out / "published.csv", render_published_csv(report.published))
    if options.latex:
        paths["tex"] = atomic_write_text(out / "report.tex", render_latex(report.cells, report.protocol_cells))
    backbones = report.backbones
    names = figure_names(backbones)
    if len(backbones) > 1:  # the main figure: every backbone side by side; each also has its own
        for fmt, path in zip(formats, save_figure(plot_backbones(report.cells, report.colour_names), out / FIGURE_FILE,
                                                  formats)):
            paths[fmt] = path
    for i, bb in enumerate(backbones):
        fig = plot_accuracy_vs_shots(report.cells, bb, report.colour_names)
        for fmt, path in zip(formats, save_figure(fig, out / FIGURE_FILE, formats) if len(backbones) == 1 else []):
            paths[fmt] = path
        if names[bb] != FIGURE_FILE:
            for fmt, path in zip(formats, save_figure(fig, out / names[bb], formats)):
                paths[f"{fmt}:{bb}"] = path
    cost_backbones = sorted({c.backbone for c in report.costs})
    cost_names = figure_names(cost_backbones, COST_FIGURE_FILE) if cost_backbones else {}
    for i, bb in enumerate(cost_backbones):
        fig = plot_cost_vs_accuracy(report.costs, bb, report.colour_names)
        for fmt, path in zip(formats, save_figure(fig, out / COST_FIGURE_FILE, formats) if i == 0 else []):
            paths[f"cost_{fmt}"] = path
        if cost_names[bb] != COST_FIGURE_FILE:
            for fmt, path in zip(formats, save_figure(fig, out / cost_names[bb], formats)):
                paths[f"cost_{fmt}:{bb}"] = path
    report.paths = paths
    paths["html"] = write_html(report, out)  # last: it embeds the figures and reads report.json
    logger.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return report
