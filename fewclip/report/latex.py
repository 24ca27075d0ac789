"""The report's LaTeX tables (``report.tex``), in the layouts of the CoOp and CoCoOp papers.

Few-shot (CoOp, Zhou et al. 2022, the few-shot tables of its appendix): per backbone, one row per (dataset,
method), one column per number of shots, the average over datasets first. Base-to-novel (CoCoOp, Zhou et al.
2022, Table 1): per backbone and dataset, one row per method with Base, New and H. Cross-dataset and domain
shift (CoCoOp, Tables 2 and 3): one row per method, the source then each target and their average. Each cell is
the mean over seeds; ``with_ci`` adds the 95% interval's half-width as a subscript. The best mean of a column
(among two or more methods) is bold. The tables use ``booktabs``.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from fewclip.report.runs import AVERAGE, PROTOCOL_TITLES
from fewclip.report.stats import CellStats, ProtocolCell

_SPECIAL = re.compile(r"([&%$#_{}~^|\\])")


def tex(text: str) -> str:
    """``text`` with LaTeX's special characters escaped."""
    def esc(m):
        c = m.group(1)
        return {"~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}",
                "|": r"\textbar{}"}.get(c, "\\" + c)

    return _SPECIAL.sub(esc, str(text))


def _cell(mean, ci, best: bool, with_ci: bool) -> str:
    if mean is None:
        return "--"
    text = f"{mean:.1f}"
    if best:
        text = rf"\textbf{{{text}}}"
    if with_ci and ci is not None:
        text += rf"$_{{\pm {ci:.1f}}}$"
    return text


def _best(values: Sequence) -> set:
    """Indices of the best mean among two or more numbers (ties all)."""
    nums = [v for v in values if v is not None]
    if len(nums) < 2:
        return set()
    top = max(nums)
    return {i for i, v in enumerate(values) if v is not None and v == top}


def _tabular(columns: str, header: list[str], rows: list[list[str]], caption: str, label: str,
             rules_before: Sequence[int] = ()) -> list[str]:
    out = [r"\begin{table}[t]", r"\centering", r"\small", rf"\caption{{{caption}}}", rf"\label{{{label}}}",
           rf"\begin{{tabular}}{{{columns}}}", r"\toprule", " & ".join(header) + r" \\", r"\midrule"]
    for i, row in enumerate(rows):
        if i in rules_before and i:
            out.append(r"\midrule")
        out.append(" & ".join(row) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return out


def fewshot_tables(cells: Sequence[CellStats], with_ci: bool = True, metric: str = "top-1 accuracy",
                   label: str = "fewshot") -> list[str]:
    out: list[str] = []
    for bb in sorted({c.backbone for c in cells}):
        mine = [c for c in cells if c.backbone == bb]
        datasets = sorted({c.dataset for c in mine if not c.is_average})
        if len(datasets) == 1:
            mine = [c for c in mine if not c.is_average]
        shots = sorted({c.shots for c in mine})
        at = {(c.dataset, c.method, c.shots): c for c in mine}
        row_keys = list(dict.fromkeys((c.dataset, c.method) for c in mine))
        rows, rules, prev = [], [], None
        for ds, m in row_keys:
            if ds != prev:
                rules.append(len(rows))
            methods = [mm for d2, mm in row_keys if d2 == ds]
            row = [(r"\textit{Average}" if ds == AVERAGE else tex(ds)) if ds != prev else "", tex(m)]
            for s in shots:
                column = [at[(ds, mm, s)].mean if (ds, mm, s) in at else None for mm in methods]
                c = at.get((ds, m, s))
                row.append(_cell(c.mean if c else None, c.ci95 if c else None,
                                 methods.index(m) in _best(column), with_ci))
            rows.append(row)
            prev = ds
        header = ["Dataset", "Method", *(f"{s} shot{'s' if s != 1 else ''}" if s else "zero-shot" for s in shots)]
        caption = (f"Few-shot {metric} (\\%) with {tex(bb)}: mean over seeds"
                   + (", subscript: half-width of the t-based 95\\% confidence interval" if with_ci else "")
                   + "; bold: best of the column for the dataset.")
        out += _tabular("ll" + "r" * len(shots), header, rows, caption, f"tab:{label}-{_label(bb)}", rules)
    return out


def balanced_tables(cells: Sequence[CellStats], with_ci: bool = True) -> list[str]:
    """The few-shot tables of the mean per-class accuracy (balanced accuracy), then per backbone the lines
    without learning (majority class, uniform chance), where the runs record them."""
    mine = [dataclasses.replace(c, mean=c.mean_per_class, ci95=c.mean_per_class_ci95) for c in cells
            if c.mean_per_class is not None]
    out = fewshot_tables(mine, with_ci, "mean per-class accuracy (balanced accuracy)", "balanced") if mine else []
    for bb in sorted({c.backbone for c in cells}):
        rows = []
        for ds in sorted({c.dataset for c in cells if c.backbone == bb and not c.is_average}):
            here = [c for c in cells if c.backbone == bb and c.dataset == ds]
            majority = next((c.majority for c in here if c.majority is not None), None)
            chance = next((c.chance for c in here if c.chance is not None), None)
            if majority is not None or chance is not None:
                rows.append([tex(ds), "--" if majority is None else f"{majority:.1f}",
                             "--" if chance is None else f"{chance:.1f}"])
        if rows:
            out += _tabular("lrr", ["Dataset", "Majority class", "Uniform chance"], rows,
                            f"Top-1 accuracy (\\%) without learning with {tex(bb)}: always the largest test class, "
                            f"and uniform guessing (the mean per-class accuracy of both is chance).",
                            f"tab:without-learning-{_label(bb)}")
    return out


def protocol_tables(cells: Sequence[ProtocolCell], with_ci: bool = False) -> list[str]:
    out: list[str] = []
    for protocol in ("base2new", "cross_dataset", "domain_shift"):
        mine = [c for c in cells if c.protocol == protocol]
        for bb in sorted({c.backbone for c in mine}):
            here = [c for c in mine if c.backbone == bb]
            at: dict[tuple, ProtocolCell] = {(c.dataset, c.method, c.shots, c.eval): c for c in here}
            rows_keys = list(dict.fromkeys((c.dataset, c.method, c.shots) for c in here))
            if protocol == "base2new":
                evals = ["base", "new", "hm"]
                header = ["Dataset", "Method", "Shots", "Base", "New", "H"]
            else:
                targets = list(dict.fromkeys(c.eval for c in here if c.eval not in ("source", AVERAGE)))
                evals = ["source", *targets, AVERAGE]
                header = ["Source", "Method", "Shots", "Source", *(tex(t) for t in targets), "Average"]
            rows, rules, prev = [], [], None
            for ds, m, k in rows_keys:
                if ds != prev:
                    rules.append(len(rows))
                group = [(d2, m2, k2) for d2, m2, k2 in rows_keys if d2 == ds]
                row = [(r"\textit{Average}" if ds == AVERAGE else tex(ds)) if ds != prev else "", tex(m), str(k)]
                for e in evals:
                    column = [at[(d2, m2, k2, e)].mean if (d2, m2, k2, e) in at else None for d2, m2, k2 in group]
                    c = at.get((ds, m, k, e))
                    best = group.index((ds, m, k)) in _best(column)
                    row.append(_cell(c.mean if c else None, c.ci95 if c else None, best, with_ci))
                rows.append(row)
                prev = ds
            caption = (f"{PROTOCOL_TITLES[protocol]} with {tex(bb)}: top-1 accuracy (\\%), mean over seeds"
                       + ("; H: harmonic mean of Base and New" if protocol == "base2new" else "")
                       + "; bold: best of the column for the dataset.")
            out += _tabular("llr" + "r" * len(evals), header, rows, caption, f"tab:{protocol}-{_label(bb)}", rules)
    return out


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def render_latex(cells: Sequence[CellStats], protocol_cells: Sequence[ProtocolCell] = ()) -> str:
    """Every table of the report as LaTeX (needs ``\\usepackage{booktabs}``)."""
    lines = ["% fewclip report tables; \\usepackage{booktabs} in the preamble", ""]
    lines += fewshot_tables(cells)
    lines += balanced_tables(cells)
    lines += protocol_tables(protocol_cells)
    return "\n".join(lines)
