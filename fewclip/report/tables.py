"""The report's tables: Markdown, CSV and JSON."""
from __future__ import annotations

import csv
import io
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fewclip.data.protocols import PROTOCOLS
from fewclip.report.plan import PlannedRun, unfinished_markdown
from fewclip.report.runs import (
    AVERAGE,
    COST_COLUMNS,
    COST_FIGURE_FILE,
    CSV_COLUMNS,
    FEWSHOT,
    FIGURE_FILE,
    NA,
    PROTOCOL_TITLES,
    ZEROSHOT,
    RunResult,
    SkippedFile,
)
from fewclip.report.stats import CellStats, CostStats, ProtocolCell

logger = logging.getLogger(__name__)


# Markdown


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A pipe table padded so it also reads well as plain text. A ``|`` inside a cell (a method, dataset or
    backbone named with one) is written ``\\|``, so it cannot split its row."""
    headers = [_md_text(h) for h in headers]
    rows = [[_md_text(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    aligns = ["<", "<"] + [">"] * (len(headers) - 2)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == ">" else ("-" * (w + 2))
                          for a, w in zip(aligns, widths)) + "|"
    return [line(headers), rule, *(line(r) for r in rows)]


def _md_text(text: str) -> str:
    """A table cell's text: a ``|`` (a method, dataset or backbone named with one) written ``\\|`` and a line
    break as a space, so neither can split its row."""
    return " ".join(str(text).replace("|", "\\|").splitlines())


FEWER_MARK = "‡"  # a cell whose runs had fewer training images than shots in some class
OTHER_MARK = "§"  # a cell holding runs of another config than the sweep plan's (or outside it)
UNRECORDED_MARK = "◊"  # a cell holding a metrics.json without a run record
_LISTED = 12  # cells listed under a mark's note, then how many more


def _marks(c: CellStats) -> str:
    return ((FEWER_MARK if c.fewest_shots is not None else "") + (OTHER_MARK if c.other_config else "")
            + (UNRECORDED_MARK if c.unrecorded else ""))


def _fmt_cell(c: CellStats, n_datasets: int, best: bool, balanced: bool = False) -> str:
    mean, ci95 = (c.mean_per_class, c.mean_per_class_ci95) if balanced else (c.mean, c.ci95)
    n = c.mean_per_class_n if balanced else c.n
    if mean is None:
        return "–"
    text = f"{mean:.2f}"
    if best:
        text = f"**{text}**"
    mark = _marks(c)
    if c.is_average:
        return (text if c.complete else f"{text} ({c.n}/{n_datasets})†") + mark
    if ci95 is not None:
        lo, hi = mean - ci95, mean + ci95
        # An interval past 0 or 100% is shown clipped, as its ends, not as a symmetric half-width.
        text += f" ± {ci95:.2f}" if 0 <= lo and hi <= 100 else f" [{max(lo, 0):.2f}, {min(hi, 100):.2f}]"
    # n of the planned runs where a sweep plan planned more than finished
    count = f"{n}/{c.planned}" if c.planned is not None and c.planned != n else str(n)
    return f"{text} ({count}){mark}"


def _fmt_unfinished(ps: Sequence[PlannedRun]) -> str:
    """A cell that a sweep planned and that has no finished run."""
    failed = sum(p.status == "failed" for p in ps)
    return f"– (0/{len(ps)}" + (f", {failed} failed" if failed else "") + ")"


def figure_names(backbones: Sequence[str], main: str = FIGURE_FILE) -> dict[str, str]:
    """backbone -> figure file name (the first backbone gets the main name too)."""
    if len(backbones) == 1:
        return {backbones[0]: main}
    names: dict[str, str] = {}
    for bb in backbones:
        stem = f"{Path(main).stem}_{re.sub(r'[^A-Za-z0-9._-]+', '_', bb)}"
        name, k = f"{stem}.png", 2
        while name in names.values():  # "a/b" and "a_b" must not share a file
            name, k = f"{stem}_{k}.png", k + 1
        names[bb] = name
    return names


def _backbone_markdown(bb: str, cells: list[CellStats], figure: str,
                       planned: Sequence[PlannedRun] = ()) -> list[str]:
    planned = [p for p in planned if p.backbone == bb and p.protocol == FEWSHOT]
    datasets = sorted({c.dataset for c in cells if not c.is_average} | {p.dataset for p in planned})
    if len(datasets) == 1:  # the average would repeat the dataset's rows
        cells = [c for c in cells if not c.is_average]
    at = {(c.dataset, c.method, c.shots): c for c in cells}
    empty: dict[tuple, list[PlannedRun]] = {}  # planned cells without a finished run
    for p in planned:
        if (p.dataset, p.method, p.shots) not in at:
            empty.setdefault((p.dataset, p.method, p.shots), []).append(p)
    # rows in the cells' order (stats._cell_key), planned rows without a finished run among them
    row_keys = sorted(dict.fromkeys([(c.dataset, c.method) for c in cells] + [(ds, m) for ds, m, _ in empty]),
                      key=lambda k: (k[0] == AVERAGE, k[0], k[1] != ZEROSHOT, k[1]))
    shots = sorted({c.shots for c in cells} | {k for _, _, k in empty})

    # Best mean per (dataset, shots) among 2+ methods; ties all bold.
    best: dict[tuple[str, int], float] = {}
    counts: dict[tuple[str, int], int] = {}
    for c in cells:
        k = (c.dataset, c.shots)
        best[k] = max(best.get(k, -math.inf), c.mean)
        counts[k] = counts.get(k, 0) + 1

    def label(ds: str) -> str:
        return "**average**" if ds == AVERAGE else ds

    headers = ["Dataset", "Method", *(f"{s}-shot" for s in shots)]
    rows = []
    for ds, method in row_keys:
        row = [label(ds), method]
        for s in shots:
            c = at.get((ds, method, s))
            is_best = c is not None and counts[(ds, s)] > 1 and c.mean == best[(ds, s)]
            row.append(_fmt_unfinished(empty[(ds, method, s)]) if (ds, method, s) in empty else
                       "–" if c is None else _fmt_cell(c, len(datasets), is_best))
        rows.append(row)

    out = [f"## Backbone `{bb}`", "", *_md_table(headers, rows), ""]

    # Mean per-class accuracy (balanced accuracy) in the same layout, and what no learning gets.
    if any(c.mean_per_class is not None for c in cells):
        b_best: dict[tuple[str, int], float] = {}
        b_counts: dict[tuple[str, int], int] = {}
        for c in cells:
            if c.mean_per_class is not None:
                k = (c.dataset, c.shots)
                b_best[k] = max(b_best.get(k, -math.inf), c.mean_per_class)
                b_counts[k] = b_counts.get(k, 0) + 1
        b_rows = []
        for ds, method in row_keys:
            row = [label(ds), method]
            for s in shots:
                c = at.get((ds, method, s))
                is_best = (c is not None and c.mean_per_class is not None and b_counts[(ds, s)] > 1
                           and c.mean_per_class == b_best[(ds, s)])
                row.append(_fmt_unfinished(empty[(ds, method, s)]) if (ds, method, s) in empty else
                           "–" if c is None else _fmt_cell(c, len(datasets), is_best, balanced=True))
            b_rows.append(row)
        out += [f"### Mean per-class accuracy, `{bb}` (balanced accuracy: the mean over classes of each class's "
                f"top-1, %)", "", *_md_table(headers, b_rows), ""]
    refs = _reference_rows(cells)
    if refs:
        out += [f"### Without learning, `{bb}`: always the largest test class, and uniform chance (%)", "",
                *_md_table(["Dataset", "Line", "Top-1", "Mean per-class"], refs), ""]

    delta_cells = [c for c in cells if c.method != ZEROSHOT and c.delta_zeroshot is not None]
    if not any(c.method == ZEROSHOT and c.shots == 0 for c in cells):
        out += ["No zero-shot run for this backbone, so no gain over zero-shot.", ""]
    elif delta_cells:
        d_shots = sorted({c.shots for c in delta_cells})
        d_rows = list(dict.fromkeys((c.dataset, c.method) for c in delta_cells))
        d_at = {(c.dataset, c.method, c.shots): c for c in delta_cells}
        out += [f"### Gain over zero-shot, `{bb}` (accuracy points, mean − zero-shot mean)", ""]
        body = [[label(ds), m, *(f"{d_at[(ds, m, s)].delta_zeroshot:+.2f}" if (ds, m, s) in d_at else "–"
                                 for s in d_shots)] for ds, m in d_rows]
        out += [*_md_table(["Dataset", "Method", *(f"{s}-shot" for s in d_shots)], body), ""]

    fewer = [c for c in cells if c.fewest_shots is not None and not c.is_average]
    if fewer:
        out.append(f"{FEWER_MARK} Fewer training images than shots in some class (data.allow_fewer_shots; each run's "
                   f"`shots_per_class` in its metrics.json):")
        for c in fewer:
            out.append(f"- `{c.method}` on {c.dataset} at {c.shots} shots: the fewest {c.fewest_shots} per class")
        out.append("")
    incomplete = [c for c in cells if c.is_average and not c.complete]
    if incomplete:
        out.append("† Average over only some datasets:")
        for c in incomplete:
            missing = ", ".join(d for d in datasets if d not in c.datasets)
            out.append(f"- `{c.method}` at {c.shots} shots: {', '.join(c.datasets)} (missing: {missing})")
        out.append("")
    other = [c for c in cells if c.other_config and not c.is_average]
    if other:
        out.append(f"{OTHER_MARK} Runs of another config than this folder's sweep plan (`sweep_plan.json`), or "
                   f"not in it: these numbers do not belong to the sweep the plan describes; rerun the sweep, or "
                   f"report each sweep's own out folder:")
        for c in other:
            out.append(f"- `{_md_text(c.method)}` on {_md_text(c.dataset)} at {c.shots} shots: {c.other_config} of "
                       f"{c.n} run(s)")
        out.append("")
    unrecorded = [c for c in cells if c.unrecorded and not c.is_average]
    if unrecorded:
        what = (f"{UNRECORDED_MARK} Runs whose metrics.json has no run record (written by an older fewclip, or by "
                f"hand): nothing vouches that its numbers are those of its files")
        if all(c.unrecorded == c.n for c in cells if not c.is_average):
            out += [f"{what}; here every run is one.", ""]
        else:
            out.append(what + ":")
            for c in unrecorded[:_LISTED]:
                out.append(f"- `{_md_text(c.method)}` on {_md_text(c.dataset)} at {c.shots} shots: {c.unrecorded} "
                           f"of {c.n} run(s)")
            out += [f"- and {len(unrecorded) - _LISTED} more cells"] if len(unrecorded) > _LISTED else []
            out.append("")
    out += unfinished_markdown(planned, bb)
    if figure:
        out += [f"![accuracy vs. shots, {bb}]({figure})", ""]
    return out


def _plan_sentence(planned: Sequence[PlannedRun]) -> str:
    """How the sweep plan's runs ended, and per method how many did not finish."""
    status = {k: sum(p.status == k for p in planned) for k in ("finished", "failed", "missing", "other config")}
    text = (f"The sweep planned {len(planned)} runs: {status['finished']} finished, {status['failed']} failed, "
            f"{status['missing']} missing" + (f", {status['other config']} finished with another config "
                                             f"({OTHER_MARK})" if status["other config"] else "") + ".")
    bad: dict[str, list[int]] = {}
    for p in planned:
        counts = bad.setdefault(p.method, [0, 0, 0])
        counts[0] += 1
        counts[1] += p.status == "failed"
        counts[2] += p.status == "missing"
    per = [f"`{_md_text(m)}` {f} of {n} failed" + (f", {x} missing" if x else "") if f else
           f"`{_md_text(m)}` {x} of {n} missing" for m, (n, f, x) in sorted(bad.items()) if f or x]
    return text + (" Not finished, per method: " + "; ".join(per) + " (listed under each backbone)." if per else "")


def _reference_rows(cells: Sequence[CellStats]) -> list[list[str]]:
    """Per dataset: the majority-class line (top-1 of always answering the largest test class; its mean per-class
    accuracy is 100 / classes) and the uniform-chance line (100 / classes, both metrics)."""
    rows = []
    for ds in sorted({c.dataset for c in cells if not c.is_average}):
        here = [c for c in cells if c.dataset == ds]
        majority = [c.majority for c in here if c.majority is not None]
        chance = [c.chance for c in here if c.chance is not None]
        if majority:
            lo, hi = min(majority), max(majority)
            top1 = f"{lo:.2f}" if hi - lo < 5e-3 else f"{lo:.2f}–{hi:.2f} (test sets differ)"
            rows.append([ds, "majority class", top1, f"{chance[0]:.2f}" if chance else "–"])
        if chance:
            rows.append([ds, "uniform chance", f"{chance[0]:.2f}", f"{chance[0]:.2f}"])
    return rows


def _fmt_cost(key: str, value: float | None) -> str:
    if value is None:
        return "–"
    if key in ("trainable_parameters", "images_encoded", "peak_memory_mib") or value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def _cost_markdown(bb: str, costs: list[CostStats], figure: str) -> list[str]:
    headers = ["Method", "Shots", *COST_COLUMNS.values(), "Top-1 (%)", "Runs"]
    rows = [[c.method, str(c.shots), *(_fmt_cost(k, getattr(c, k)) for k in COST_COLUMNS),
             "–" if c.top1 is None else f"{c.top1:.2f}", str(c.n)] for c in costs]
    memory = {k for c in costs for k in c.memory.split("+") if k}
    where = {"rss": "the process's peak resident memory on the CPU", "cuda": "the CUDA allocator's peak"}
    return [
        f"### Cost, `{bb}` (mean per run over datasets and seeds)",
        "",
        *_md_table(headers, rows),
        "",
        "Training time is the loop or fit alone; wall time the whole run (its split to its test accuracy). "
        "Images encoded counts every image the run passed through an image tower, test images and cached views "
        "included: features shared between the runs of a sweep are charged in full to every run that uses them. "
        f"Peak memory: {' and '.join(where[k] for k in sorted(memory)) or 'not recorded'}"
        + (" (it includes the backbone and, in a sweep, the shared feature cache)." if "rss" in memory else "."),
        "",
        f"![cost vs. accuracy, {bb}]({figure})",
        "",
    ]


def _fmt_protocol_cell(c: ProtocolCell | None) -> str:
    if c is None:
        return "–"
    if c.mean is None:
        return NA
    text = f"{c.mean:.2f}"
    if c.derived:
        return text if c.complete else f"{text}†"
    if c.ci95 is not None:
        text += f" ± {c.ci95:.2f}"
    return f"{text} ({c.n})"


_PROTOCOL_NOTES = {
    "base2new": (
        "CoCoOp's Table 1. Base: the base classes' test images among the base classes (the classes trained on); "
        "New: the new classes' test images among the new classes, none of which was trained on; mean over seeds "
        "± 95% CI (seeds in brackets). H: the harmonic mean of the Base and New seed means; on the average rows, "
        "of the averaged Base and New."),
    "cross_dataset": (
        "CoCoOp's Table 2. Source: the source's test images; each target: its test images among its own classes, "
        "scored with its own class names; mean over seeds ± 95% CI (seeds in brackets). Average: the mean over "
        "the targets of their seed means."),
    "domain_shift": (
        "CoCoOp's Table 3. Source: the source's test images; each target (a shifted version of the source with "
        "its classes, or some of them): its test images among its own classes; mean over seeds ± 95% CI (seeds in "
        "brackets). Average: the mean over the targets of their seed means."),
}


def _protocol_markdown(protocol: str, cells: list[ProtocolCell]) -> list[str]:
    out = [f"## {PROTOCOL_TITLES[protocol]} (`{protocol}`)", "", _PROTOCOL_NOTES[protocol] + " n/a: the method "
           "cannot score classes it was not trained on (one weight per trained class).", ""]
    for bb in sorted({c.backbone for c in cells}):
        here = [c for c in cells if c.backbone == bb]
        at = {(c.dataset, c.method, c.shots, c.eval): c for c in here}
        rows = list(dict.fromkeys((c.dataset, c.method, c.shots) for c in here))  # sorted: average block first
        if protocol == "base2new":
            body = [["**average**" if ds == AVERAGE else ds, m, str(k),
                     *(_fmt_protocol_cell(at.get((ds, m, k, e))) for e in ("base", "new", "hm"))]
                    for ds, m, k in rows]
            out += [f"### `{bb}`", "", *_md_table(["Dataset", "Method", "Shots", "Base", "New", "H"], body), ""]
            partial = sorted({(c.method, c.shots, c.datasets) for c in here if c.is_average and not c.complete})
            for m, k, names in partial:
                out.append(f"† `{m}` at {k} shots: average over {', '.join(names)} only")
            out += [""] if partial else []
            continue
        for ds in dict.fromkeys(ds for ds, _, _ in rows):
            targets = list(dict.fromkeys(c.eval for c in here if c.dataset == ds
                                         and c.eval not in ("source", AVERAGE)))
            body = [[m, str(k), *(_fmt_protocol_cell(at.get((ds, m, k, e))) for e in ("source", *targets, AVERAGE))]
                    for d, m, k in rows if d == ds]
            headers = ["Method", "Shots", f"Source: {ds}", *targets, "Average"]
            out += [f"### `{bb}`, from `{ds}`", "", *_md_table(headers, body), ""]
    return out


def render_markdown(run_root: Path, runs: list[RunResult], cells: list[CellStats],
                    skipped: list[SkippedFile], costs: Sequence[CostStats] = (),
                    protocol_cells: Sequence[ProtocolCell] = (), *, planned: Sequence[PlannedRun] = ()) -> str:
    figures = figure_names(sorted({c.backbone for c in cells}))
    backbones = sorted({c.backbone for c in cells} | {p.backbone for p in planned if p.protocol == FEWSHOT})
    cost_figures = figure_names(sorted({c.backbone for c in costs}), COST_FIGURE_FILE) if costs else {}
    out = [
        "# fewclip report",
        "",
        f"{len(runs)} runs from "
        + (", ".join(f"`{r}`" for r in run_root) if isinstance(run_root, (list, tuple)) else f"`{run_root}`")
        + (f" ({len(skipped)} file(s) skipped, listed at the end)." if skipped else "."),
        "",
    ]
    if planned:
        out += [_plan_sentence(planned), ""]
    if cells:
        out += [
            "Cells: mean top-1 accuracy (%) over seeds ± 95% confidence half-width "
            "(Student's t, sample std), number of seeds in brackets (n/N: n of the N runs the sweep planned "
            "finished; – (0/N): none did); one seed gives the mean alone; an interval "
            "that passes 0 or 100% is shown as its ends, clipped [low, high]. "
            "**Bold**: best mean in that column for that dataset. "
            "Average rows: mean over datasets of the per-dataset means. The mean per-class accuracy (balanced "
            "accuracy) follows each top-1 table, and the lines without learning (always the largest class, "
            "uniform chance) follow that: on an imbalanced test set top-1 alone rewards favouring the largest class.",
            "",
        ]
    if len(figures) > 1:
        out += [f"![accuracy vs. shots, every backbone]({FIGURE_FILE})", ""]
    for bb in backbones:
        out += _backbone_markdown(bb, [c for c in cells if c.backbone == bb], figures.get(bb), planned)
        if bb in cost_figures:
            out += _cost_markdown(bb, [c for c in costs if c.backbone == bb], cost_figures[bb])
    for protocol in PROTOCOLS:
        mine = [c for c in protocol_cells if c.protocol == protocol]
        if mine:
            out += _protocol_markdown(protocol, mine)
        if protocol != FEWSHOT:  # a protocol sweep's runs that did not finish
            for bb in sorted({p.backbone for p in planned if p.protocol == protocol}):
                out += unfinished_markdown(planned, bb, protocol)
    if skipped:
        out += ["## Skipped files", ""]
        for s in skipped:
            try:
                shown = s.path.relative_to(run_root)
            except ValueError:
                shown = s.path
            out.append(f"- `{shown}`: {s.reason}")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------
# CSV / JSON


def _num(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def render_csv(cells: Sequence[CellStats], protocol_cells: Sequence[ProtocolCell] = ()) -> str:
    """Every cell, few-shot (protocol ``fewshot``, eval ``all``) then the protocols'; an empty ``mean`` is "n/a"
    (or, on an average row, an average over a cell that is)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for c in [*cells, *protocol_cells]:
        w.writerow([
            c.backbone, c.dataset, c.method, c.shots,
            *("" if v is None else v for v in map(_num, (c.mean, c.std, c.ci95))),
            c.n, "" if c.delta_zeroshot is None else _num(c.delta_zeroshot),
            ";".join(map(str, c.seeds)), ";".join(c.datasets),
            getattr(c, "protocol", FEWSHOT), getattr(c, "eval", "all"),
            *("" if v is None else v for v in map(_num, (getattr(c, "mean_per_class", None),
                                                         getattr(c, "mean_per_class_std", None),
                                                         getattr(c, "mean_per_class_ci95", None)))),
            getattr(c, "mean_per_class_n", ""),
            *("" if v is None else v for v in map(_num, (getattr(c, "majority", None), getattr(c, "chance", None)))),
            "" if getattr(c, "planned", None) is None else c.planned,
            len(getattr(c, "failed", ())) if getattr(c, "planned", None) is not None else "",
            getattr(c, "missing", "") if getattr(c, "planned", None) is not None else "",
            getattr(c, "other_config", ""), getattr(c, "unrecorded", ""),
        ])
    return buf.getvalue()


def to_json(report_root: Path, runs: list[RunResult], cells: Sequence[CellStats],
            skipped: Sequence[SkippedFile], costs: Sequence[CostStats] = (),
            protocol_cells: Sequence[ProtocolCell] = ()) -> dict:
    """``backbones[bb]["results"][dataset or "average"][method][str(shots)]`` -> stats (the few-shot protocol);
    ``backbones[bb]["cost"][method][str(shots)]`` -> mean cost per run;
    ``protocols[protocol][bb][dataset or "average"][method][str(shots)][eval]`` -> stats, ``mean`` null and
    ``na`` the reason where the method cannot score the test set."""
    backbones: dict[str, Any] = {}
    for c in cells:
        bb = backbones.setdefault(c.backbone, {"datasets": [], "results": {}})
        if not c.is_average and c.dataset not in bb["datasets"]:
            bb["datasets"].append(c.dataset)
        entry = {"mean": _num(c.mean), "std": _num(c.std), "ci95": _num(c.ci95), "n": c.n,
                 "delta_zeroshot": _num(c.delta_zeroshot),
                 "mean_per_class": _num(c.mean_per_class), "mean_per_class_std": _num(c.mean_per_class_std),
                 "mean_per_class_ci95": _num(c.mean_per_class_ci95), "mean_per_class_n": c.mean_per_class_n,
                 "majority": _num(c.majority), "chance": _num(c.chance),
                 "other_config": c.other_config, "unrecorded": c.unrecorded}
        if c.planned is not None:
            entry.update(planned=c.planned, failed=list(c.failed), missing=c.missing)
        if c.is_average:
            entry.update(datasets=list(c.datasets), complete=c.complete)
        else:
            entry.update(seeds=list(c.seeds), values=list(c.values))
        bb["results"].setdefault(c.dataset, {}).setdefault(c.method, {})[str(c.shots)] = entry
    for c in costs:
        bb = backbones.setdefault(c.backbone, {"datasets": [], "results": {}})
        bb.setdefault("cost", {}).setdefault(c.method, {})[str(c.shots)] = {
            **{k: _num(getattr(c, k)) for k in COST_COLUMNS}, "memory": c.memory, "runs": c.n,
            "top1": _num(c.top1)}
    protocols: dict[str, Any] = {}
    for c in protocol_cells:
        entry = {"mean": _num(c.mean), "std": _num(c.std), "ci95": _num(c.ci95), "n": c.n,
                 "delta_zeroshot": _num(c.delta_zeroshot)}
        if c.mean is None:
            entry["na"] = c.reason or NA
        if c.is_average or c.eval == AVERAGE:
            entry.update(datasets=list(c.datasets), complete=c.complete)
        if not c.derived:
            entry.update(seeds=list(c.seeds), values=list(c.values))
        (protocols.setdefault(c.protocol, {}).setdefault(c.backbone, {}).setdefault(c.dataset, {})
         .setdefault(c.method, {}).setdefault(str(c.shots), {}))[c.eval] = entry
    return {
        "run_root": str(report_root),
        "n_runs": len(runs),
        "protocols": protocols,
        "conventions": {
            "std": "sample standard deviation (ddof=1); null with one seed",
            "ci95": "t(0.975, n-1) * std / sqrt(n); null with one seed",
            "delta_zeroshot": "mean - zero-shot mean of the same backbone and dataset (points)",
            "mean_per_class": "mean per-class accuracy (balanced accuracy): the mean over the test classes of each "
                              "class's top-1, over the seeds that record it (mean_per_class_n)",
            "majority": "top-1 of always answering the largest test class (its mean per-class accuracy is chance)",
            "chance": "100 / number of classes",
            "planned": "runs the sweep plan (sweep_plan.json) has for the cell; failed: 'seed S: first line of its "
                       "error'; missing: neither finished nor failed; planned_runs lists each with its status",
            "other_config": "finished runs of another config than the sweep plan's, or not in it",
            "unrecorded": "runs whose metrics.json has no run record",
            "average": "mean over the datasets listed of the per-dataset means; n counts datasets",
            "cost": "mean over the runs (datasets and seeds) that record it; images encoded include shared "
                    "features, charged in full to every run that uses them; peak memory in MiB (memory: "
                    "rss = process peak resident memory, cuda = the CUDA allocator's peak)",
            "protocols": "per test set (eval) over seeds; hm: harmonic mean of the base and new seed means "
                         "(on the average over datasets: of the averaged base and new); average (eval): mean "
                         "over the targets of their seed means; mean null: n/a (na says why)",
        },
        "backbones": backbones,
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in skipped],
    }


# ----------------------------------------------------------------------------
