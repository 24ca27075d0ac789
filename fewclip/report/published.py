"""The report's comparison with published results (``fewclip.published``): for every published row whose setting
a group of runs matches, the runs' mean over seeds, the published value and the gap in standard errors.

A run matches a row when its method (its registered name, before the report's ``rename``), its backbone (by the
sha256 of its weights file where that is a published file's, else its open_clip ``ARCH/TAG``, ``-quickgelu``
dropped: :func:`fewclip.published.backbone_key`), dataset, protocol, shots and metric are the row's:

* ``fewshot``: ``top1`` of runs on that dataset;
* ``base2new``: ``base`` and ``new`` are the test sets' top-1, ``hm`` the harmonic mean of the two seed means
  (as the report's base-to-novel table), its standard error that of the per-seed harmonic means;
* ``domain_shift``/``cross_dataset``: the row's dataset is a test set (``source`` when it is the training set),
  ``train_dataset`` the run's dataset;
* ``dataset == "average"``: the mean over the 11 datasets of CoOp's benchmark, per seed, over the seeds run
  on all 11 (a partial set of datasets matches nothing).

The gap is ``(mean - published) / SE`` with ``SE = std(ddof=1) / sqrt(n)`` over the seeds; with one seed (or
seeds that all agree) it is undefined: ``None``, "n/a" in the tables.
"""
from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from fewclip.published import AVERAGE, ELEVEN, PublishedRow, backbone_key, display_dataset, shipped_table
from fewclip.report.runs import FEWSHOT, NA, RunResult
from fewclip.utils.io import read_json

PUBLISHED_CSV_COLUMNS = ("method", "backbone", "dataset", "train_dataset", "protocol", "shots", "metric", "mean", "n",
                         "se", "published", "gap_se", "source", "note")

# (protocol, method, backbone, dataset, shots, metric, train_dataset)
Key = tuple[str, str, str, str, int, str, str]


@dataclass(frozen=True)
class Comparison:
    """A published row and the matching runs: their mean over ``n`` seeds, its standard error and the gap."""

    row: PublishedRow
    method: str  # as the report shows it (after rename)
    mean: float
    n: int
    se: Optional[float]
    gap: Optional[float]


def _harmonic(a: float, b: float) -> float:
    return 2 * a * b / (a + b) if a + b > 0 else 0.0


def _weights_sha256(run: RunResult) -> Optional[str]:
    """The sha256 of the run's backbone weights as its metrics.json records it (``backbone_info``), if any."""
    try:
        info = read_json(run.path).get("backbone_info") or {}
    except (OSError, ValueError, AttributeError):
        return None
    sha = info.get("weights_sha256") if isinstance(info, dict) else None
    return sha if isinstance(sha, str) else None


def seed_values(runs: Sequence[RunResult], rename: Mapping[str, str] | None = None) -> dict[Key, dict[int, float]]:
    """Per matching key, seed -> value (base2new's ``hm`` left out: it is derived from base and new)."""
    back = {shown: orig for orig, shown in (rename or {}).items()}
    out: dict[Key, dict[int, float]] = defaultdict(dict)
    for r in runs:
        head, plus, tail = r.method.partition("+")
        method = back.get(r.method) or back.get(head, head) + plus + tail
        bb = backbone_key(r.backbone, _weights_sha256(r))
        if r.protocol == FEWSHOT:
            out[(FEWSHOT, method, bb, r.dataset, r.shots, "top1", "")][r.seed] = r.top1
        elif r.protocol == "base2new":
            for metric in ("base", "new"):
                if r.evals.get(metric) is not None:
                    out[(r.protocol, method, bb, r.dataset, r.shots, metric, "")][r.seed] = r.evals[metric]
        else:
            for name, v in r.evals.items():
                if v is not None:
                    test = r.dataset if name == "source" else name
                    out[(r.protocol, method, bb, test, r.shots, "top1", r.dataset)][r.seed] = v
    # Averages over the 11 datasets, per seed, for the seeds that have all 11; a transfer run trained on one of
    # them (cross-dataset from ImageNet): over the ten others, as CoCoOp's Table 2 averages its targets.
    groups: dict[tuple, dict[str, dict[int, float]]] = defaultdict(dict)
    for (protocol, method, bb, ds, shots, metric, train), seeds in out.items():
        if ds in ELEVEN and ds != train:
            groups[(protocol, method, bb, shots, metric, train)][ds] = seeds
    for (protocol, method, bb, shots, metric, train), by_ds in groups.items():
        tests = [d for d in ELEVEN if d != train]
        if set(by_ds) != set(tests):
            continue
        common = set.intersection(*(set(s) for s in by_ds.values()))
        if common:
            out[(protocol, method, bb, AVERAGE, shots, metric, train)] = {
                s: statistics.fmean(by_ds[d][s] for d in tests) for s in sorted(common)}
    return out


def _stats(values: Sequence[float]) -> tuple[float, Optional[float]]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return mean, se


def compare(runs: Sequence[RunResult], rename: Mapping[str, str] | None = None,
            table: Sequence[PublishedRow] | None = None) -> list[Comparison]:
    """Every published row (default: the shipped table) that the runs match, with the runs' mean and the gap."""
    table = shipped_table() if table is None else table
    values = seed_values(runs, rename)
    shown = {orig: new for orig, new in (rename or {}).items()}
    out = []
    for row in table:
        key = (row.protocol, row.method, row.backbone, row.dataset, row.shots, row.metric, row.train_dataset)
        if row.metric == "hm":
            base = values.get(key[:5] + ("base", key[6]), {})
            new = values.get(key[:5] + ("new", key[6]), {})
            seeds = sorted(set(base) & set(new))
            if not seeds:
                continue
            per_seed = [_harmonic(base[s], new[s]) for s in seeds]
            mean = _harmonic(statistics.fmean(base[s] for s in seeds), statistics.fmean(new[s] for s in seeds))
            se = _stats(per_seed)[1]
        elif key in values:
            per_seed = list(values[key].values())
            mean, se = _stats(per_seed)
        else:
            continue
        gap = (mean - row.value) / se if se else None
        out.append(Comparison(row=row, method=shown.get(row.method, row.method), mean=mean, n=len(per_seed), se=se,
                              gap=gap))
    # by setting; stable, so base, new, hm and several sources of one setting keep the table's order
    return sorted(out, key=lambda c: (c.row.method, c.row.backbone, c.row.protocol, c.row.train_dataset,
                                      c.row.dataset != AVERAGE, c.row.dataset, c.row.shots))


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return NA if x is None else format(x, spec)


def render_published_markdown(comparisons: Sequence[Comparison]) -> str:
    """The report.md section: one line per matched published result."""
    if not comparisons:
        return ""
    lines = [
        "## Published results",
        "",
        "Settings of these runs that a published result shares (`fewclip published` lists them all): yours is the "
        "mean over your seeds, gap = (yours - published) / SE, SE the standard error of that mean over the seeds "
        "(n/a with one seed). An average is over the 11 datasets of CoOp's benchmark, per seed, for the seeds run "
        "on all 11.",
        "",
        "| Method | Backbone | Dataset | Protocol | Shots | Metric | Yours | n | Published | Gap (SE) | Source |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for c in comparisons:
        r = c.row
        ds = display_dataset(r)
        method = c.method.replace("|", "\\|")  # a user's method named with a pipe stays in its cell
        lines.append(f"| {method} | {r.backbone} | {ds} | {r.protocol} | {r.shots} | {r.metric} | {c.mean:.2f} | "
                     f"{c.n} | {r.value:.2f} | {_fmt(c.gap, '+.1f')} | {r.source} |")
    return "\n".join(lines) + "\n"


def render_published_csv(comparisons: Sequence[Comparison]) -> str:
    """``published.csv``: the comparison, one row per matched published result (empty cells: undefined)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(PUBLISHED_CSV_COLUMNS)
    for c in comparisons:
        r = c.row
        w.writerow([c.method, r.backbone, r.dataset, r.train_dataset, r.protocol, r.shots, r.metric,
                    f"{c.mean:.4f}", c.n, "" if c.se is None else f"{c.se:.4f}", f"{r.value:g}",
                    "" if c.gap is None else f"{c.gap:.3f}", r.source, r.note])
    return buf.getvalue()
