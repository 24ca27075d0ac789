"""Seed statistics of the report's cells: means, standard deviations and t-based 95% confidence intervals."""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fewclip.data.protocols import PROTOCOLS, base2new_table, harmonic_mean
from fewclip.report.runs import AVERAGE, COST_COLUMNS, FEWSHOT, ZEROSHOT, RunResult

logger = logging.getLogger(__name__)


# t_{0.975, df} for df = 1..30 (two-sided 95%); beyond 30 see t_critical_975.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)
_Z975 = 1.959963984540054



def t_critical_975(df: int) -> float:
    """Two-sided 95% Student's t critical value, ``t_{0.975, df}``.

    A table for df 1..30; above that the Cornish-Fisher expansion around the
    normal quantile (Abramowitz & Stegun 26.7.5), good to better than 1e-4.
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def summarize(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """``(mean, std, ci95)`` of ``values``; std and ci95 are None for one value."""
    if not values:
        raise ValueError("summarize needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    std = statistics.stdev(values)
    return mean, std, t_critical_975(len(values) - 1) * std / math.sqrt(len(values))


@dataclass(frozen=True)
class CellStats:
    """Accuracy of one (backbone, dataset, method, shots) cell over seeds.

    On an average row ``dataset == "average"``, ``n`` counts datasets and
    ``seeds`` is empty; see the module docstring for the conventions.
    """

    backbone: str
    dataset: str
    method: str
    shots: int
    mean: float
    std: float | None
    ci95: float | None
    n: int
    delta_zeroshot: float | None
    seeds: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    datasets: tuple[str, ...] = ()
    complete: bool = True
    # The fewest training images a class had in the cell's runs, where fewer than ``shots``; None otherwise.
    fewest_shots: int | None = None
    # Mean per-class accuracy (balanced accuracy) over the seeds that record it: mean, std, ci95, how many.
    # On an average row: the mean over datasets of the per-dataset means (None unless every dataset has one).
    mean_per_class: float | None = None
    mean_per_class_std: float | None = None
    mean_per_class_ci95: float | None = None
    mean_per_class_n: int = 0
    # Always answering the test set's largest class, and guessing uniformly (%); None where unknown.
    majority: float | None = None
    chance: float | None = None
    # The sweep plan's account (``fewclip.report.plan``): runs planned for the cell (None: no plan covers it),
    # failed ("seed S: first line of the error"), missing (neither finished nor failed), and finished runs of
    # another config than the plan's or outside it.
    planned: int | None = None
    failed: tuple[str, ...] = ()
    missing: int = 0
    other_config: int = 0
    # Runs whose metrics.json carries no run record (an older fewclip, or written by hand).
    unrecorded: int = 0

    @property
    def is_average(self) -> bool:
        return self.dataset == AVERAGE


def _seed_stats(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    return summarize(values) if values else (None, None, None)


@dataclass(frozen=True)
class ProtocolCell:
    """One test set (``eval``) of a (protocol, backbone, dataset, method, shots) over seeds.

    ``eval`` is a test set of the runs (``base``, ``new``; ``source``, a target), or derived from them: ``hm``
    (the harmonic mean of the base and new seed means) and ``average`` (the mean over the targets of their seed
    means). ``dataset == "average"`` (base2new with several datasets) averages over datasets, ``n`` counting
    them. ``mean`` is None where the method cannot score the test set ("n/a", ``reason`` says why); ``std`` and
    ``ci95`` are None on derived cells and with one seed."""

    protocol: str
    backbone: str
    dataset: str
    method: str
    shots: int
    eval: str
    mean: float | None
    std: float | None
    ci95: float | None
    n: int
    delta_zeroshot: float | None = None
    seeds: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    datasets: tuple[str, ...] = ()
    complete: bool = True
    reason: str = ""

    @property
    def is_average(self) -> bool:
        return self.dataset == AVERAGE

    @property
    def derived(self) -> bool:
        return self.eval in ("hm", AVERAGE) or self.is_average


@dataclass(frozen=True)
class CostStats:
    """What one (backbone, method, shots) costs: means over its runs (every dataset and seed) that record it."""

    backbone: str
    method: str
    shots: int
    n: int
    trainable_parameters: float | None
    train_time_s: float | None
    wall_time_s: float | None
    images_encoded: float | None
    peak_memory_mib: float | None
    memory: str  # "rss", "cuda" or "rss+cuda"
    top1: float | None  # the accuracy table's average over datasets (or its one dataset)



# Aggregation


def _method_key(method: str) -> tuple[int, str]:
    return (0 if method == ZEROSHOT else 1, method)


def _cell_key(c: CellStats) -> tuple:
    return (c.backbone, c.is_average, c.dataset, _method_key(c.method), c.shots)


def aggregate(runs: Iterable[RunResult]) -> list[CellStats]:
    """Per-dataset cells and, per backbone, average-over-datasets rows, sorted."""
    groups: dict[tuple[str, str, str, int], list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.backbone, r.dataset, r.method, r.shots), []).append(r)

    # Zero-shot baseline per (backbone, dataset): mean over its seeds.
    zs_mean = {
        (bb, ds): statistics.fmean(r.top1 for r in rs)
        for (bb, ds, method, shots), rs in groups.items()
        if method == ZEROSHOT and shots == 0
    }

    cells: list[CellStats] = []
    for (bb, ds, method, shots), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.seed)
        values = [r.top1 for r in rs]
        mean, std, ci95 = summarize(values)
        base = zs_mean.get((bb, ds))
        fewer = [r.fewest_shots for r in rs if r.fewest_shots is not None]
        balanced = [r.mean_per_class for r in rs if r.mean_per_class is not None]
        b_mean, b_std, b_ci = _seed_stats(balanced)
        majority = [r.majority for r in rs if r.majority is not None]
        chance = [r.chance for r in rs if r.chance is not None]
        cells.append(CellStats(
            backbone=bb, dataset=ds, method=method, shots=shots,
            mean=mean, std=std, ci95=ci95, n=len(values),
            delta_zeroshot=None if base is None else mean - base,
            seeds=tuple(r.seed for r in rs), values=tuple(values), datasets=(ds,),
            fewest_shots=min(fewer) if fewer else None,
            mean_per_class=b_mean, mean_per_class_std=b_std, mean_per_class_ci95=b_ci,
            mean_per_class_n=len(balanced),
            majority=statistics.fmean(majority) if majority else None,
            chance=statistics.fmean(chance) if chance else None,
            other_config=sum(1 for r in rs if getattr(r, "other_config", "")),
            unrecorded=sum(1 for r in rs if not r.recorded),
        ))

    datasets_of: dict[str, set[str]] = {}
    by_avg_key: dict[tuple[str, str, int], list[CellStats]] = {}
    for c in cells:
        datasets_of.setdefault(c.backbone, set()).add(c.dataset)
        by_avg_key.setdefault((c.backbone, c.method, c.shots), []).append(c)
    for (bb, method, shots), cs in by_avg_key.items():
        cs = sorted(cs, key=lambda c: c.dataset)
        deltas = [c.delta_zeroshot for c in cs]
        fewer = [c.fewest_shots for c in cs if c.fewest_shots is not None]
        balanced = [c.mean_per_class for c in cs]
        cells.append(CellStats(
            backbone=bb, dataset=AVERAGE, method=method, shots=shots,
            mean=statistics.fmean(c.mean for c in cs), std=None, ci95=None, n=len(cs),
            delta_zeroshot=None if None in deltas else statistics.fmean(deltas),
            datasets=tuple(c.dataset for c in cs),
            complete=len(cs) == len(datasets_of[bb]),
            fewest_shots=min(fewer) if fewer else None,
            mean_per_class=None if None in balanced else statistics.fmean(balanced),
            mean_per_class_n=0 if None in balanced else len(cs),
            other_config=sum(c.other_config for c in cs), unrecorded=sum(c.unrecorded for c in cs),
        ))
    return sorted(cells, key=_cell_key)


_MISSING = object()


def _eval_order(protocol: str, name: str, order: dict) -> tuple:
    fixed = {"base": 0, "new": 1, "hm": 2, "source": 0, AVERAGE: 10**6}
    return (fixed.get(name, 1 + order.get(name, 0)), name)


def _over_seeds(key: tuple, name: str, rs: list[RunResult]) -> ProtocolCell:
    seeds = tuple(r.seed for r in rs)
    values = [r.evals.get(name, _MISSING) for r in rs]
    if any(v is _MISSING for v in values):
        return ProtocolCell(*key, name, None, None, None, len(rs), seeds=seeds,
                            reason=f"tested in {sum(v is not _MISSING for v in values)} of {len(rs)} seeds")
    if any(v is None for v in values):
        return ProtocolCell(*key, name, None, None, None, len(rs), seeds=seeds,
                            reason="the method cannot score these classes")
    mean, std, ci95 = summarize(values)
    return ProtocolCell(*key, name, mean, std, ci95, len(rs), seeds=seeds, values=tuple(values))


def aggregate_protocols(runs: Iterable[RunResult]) -> list[ProtocolCell]:
    """The cells of the generalisation protocols' runs (module docstring), sorted: per (protocol, backbone,
    dataset, method, shots) each test set over seeds, then ``hm`` (base2new) or ``average`` (over targets);
    base2new with several datasets adds ``dataset == "average"`` rows; ``delta_zeroshot`` against the zero-shot
    cell of the same protocol, backbone, dataset and test set."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in runs:
        if r.protocol != FEWSHOT:
            groups.setdefault((r.protocol, r.backbone, r.dataset, r.method, r.shots), []).append(r)
    cells: list[ProtocolCell] = []
    order: dict[str, int] = {}  # targets in the order the runs list them
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.seed)
        names = list(dict.fromkeys(n for r in rs for n in r.evals))
        for n in names:
            order.setdefault(n, len(order))
        here = {n: _over_seeds(key, n, rs) for n in names}
        seeds = tuple(r.seed for r in rs)
        if key[0] == "base2new":
            b, n = here["base"].mean, here["new"].mean
            hm = None if b is None or n is None else harmonic_mean(b, n)
            here["hm"] = ProtocolCell(*key, "hm", hm, None, None, len(rs), seeds=seeds,
                                      reason="" if hm is not None else "needs base and new")
        else:
            targets = [t for t in names if t != "source"]
            means = [here[t].mean for t in targets]
            avg = None if None in means else statistics.fmean(means)
            here[AVERAGE] = ProtocolCell(*key, AVERAGE, avg, None, None, len(targets), seeds=seeds,
                                         datasets=tuple(targets), reason="" if avg is not None else "a target is n/a")
        cells.extend(here.values())

    # base2new: the average over datasets (CoCoOp's Table 1: H of the averaged base and new).
    datasets_of: dict[str, set[str]] = {}
    by_avg: dict[tuple, dict[str, tuple]] = {}
    for c in cells:
        if c.protocol == "base2new" and c.eval in ("base", "new"):
            datasets_of.setdefault(c.backbone, set()).add(c.dataset)
            row = by_avg.setdefault((c.backbone, c.method, c.shots), {}).setdefault(c.dataset, [None, None])
            row[c.eval == "new"] = c.mean
    for (bb, method, shots), rows in by_avg.items():
        if len(datasets_of[bb]) < 2:
            continue
        names = tuple(sorted(rows))
        complete = len(names) == len(datasets_of[bb])
        key = ("base2new", bb, AVERAGE, method, shots)
        if any(None in r for r in rows.values()):
            b = [r[0] for r in rows.values()]
            n = [r[1] for r in rows.values()]
            avg = {"base": None if None in b else statistics.fmean(b),
                   "new": None if None in n else statistics.fmean(n), "hm": None}
        else:
            avg = base2new_table({ds: tuple(r) for ds, r in rows.items()}).get(AVERAGE) or {}
            if len(rows) == 1:  # base2new_table adds no average row for one dataset
                (b, n), = rows.values()
                avg = {"base": b, "new": n, "hm": harmonic_mean(b, n)}
        for name in ("base", "new", "hm"):
            cells.append(ProtocolCell(*key, name, avg[name], None, None, len(names), datasets=names,
                                      complete=complete, reason="" if avg[name] is not None else "n/a in a dataset"))

    zs = {(c.protocol, c.backbone, c.dataset, c.eval): c.mean for c in cells if c.method == ZEROSHOT and c.shots == 0}
    out = []
    for c in cells:
        base = zs.get((c.protocol, c.backbone, c.dataset, c.eval))
        delta = None if c.mean is None or base is None else c.mean - base
        out.append(dataclasses.replace(c, delta_zeroshot=delta))
    return sorted(out, key=lambda c: (PROTOCOLS.index(c.protocol), c.backbone, not c.is_average, c.dataset,
                                      _method_key(c.method), c.shots, _eval_order(c.protocol, c.eval, order)))


def cost_stats(runs: Iterable[RunResult], cells: Sequence[CellStats]) -> list[CostStats]:
    """Per (backbone, method, shots), the mean cost of the runs that record one (module docstring)."""
    groups: dict[tuple[str, str, int], list[RunResult]] = {}
    for r in runs:
        if r.wall_time_s is not None:
            groups.setdefault((r.backbone, r.method, r.shots), []).append(r)
    average = {(c.backbone, c.method, c.shots): c.mean for c in cells if c.is_average}
    single = {}
    for c in cells:
        if not c.is_average:
            single.setdefault((c.backbone, c.method, c.shots), []).append(c.mean)

    def mean(rs: list[RunResult], key: str) -> float | None:
        values = [getattr(r, key) for r in rs if getattr(r, key) is not None]
        return statistics.fmean(values) if values else None

    out = []
    for (bb, method, shots), rs in groups.items():
        kinds = sorted({r.memory for r in rs if r.memory})
        top1 = average.get((bb, method, shots))
        if top1 is None and len(single.get((bb, method, shots), [])) == 1:
            top1 = single[(bb, method, shots)][0]
        out.append(CostStats(bb, method, shots, len(rs), *(mean(rs, k) for k in COST_COLUMNS), "+".join(kinds),
                             top1))
    return sorted(out, key=lambda c: (c.backbone, _method_key(c.method), c.shots))


# ----------------------------------------------------------------------------
