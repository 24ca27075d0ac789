"""The literature check (issue 31): does a reference world rank methods as the papers do?

It compares sweep results (``fewclip sweep`` folders: few-shot, base-to-novel, cross-dataset, domain shift) with
the published ViT-B/16 11-dataset averages of ``fewclip/published/results.csv`` (cross-dataset: ImageNet and the
mean of the ten other datasets; RN50 where only RN50 is published: the domain-shift family), and prints per
setting the Spearman rank correlation over the methods both sides have, and each of issue 31's findings 1-9
reproduced or not. ``scripts/literature_check.py`` runs the sweeps it needs first.

A finding is *reproduced* when the measured effect has the published one's sign and is within a factor of two of
its size (issue 31's rule); findings stated over several numbers (3, 4, 5) need every one of them.

Aggregation: per backbone, the mean over seeds, then over the tasks a method ran on; then the mean over backbones.
Base-to-novel H is the harmonic mean of the averaged base and new accuracies, as CoCoOp's Table 1 computes it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fewclip.config.presets import FEWCLIP, parse_label
from fewclip.data.protocols import TRANSFER_PROTOCOLS
from fewclip.published import AVERAGE, ELEVEN, PublishedRow, load_table

PUBLISHED_BACKBONE = "ViT-B-16/openai"
DOMAIN_SHIFT_BACKBONE = "RN50/openai"  # CoOp's Table (domain generalisation) is RN50-only in results.csv
FEWSHOT_SHOTS = (1, 2, 4, 8, 16)
ZS = "zeroshot"
# The 10 methods of issue 31's few-shot table (published at 1-16 shots, and fewclip has each of them).
FEWSHOT_METHODS = ("zeroshot", "coop", "linear_probe", "lora", "tip_adapter", "tip_adapter_f", "clip_adapter", "lpp",
                   "gda", "proker")
NOT_BASELINES = ("zeroshot", "linear_probe")  # left out in the second few-shot row
# The published transfer protocols' targets (trained on ImageNet): CoCoOp's Tables 2 and 3.
CROSS_DATASET_TARGETS = tuple(d for d in ELEVEN if d != "imagenet")
DOMAIN_SHIFT_TARGETS = ("imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r")


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's r of the tie-averaged ranks); NaN for fewer than 3 pairs or a
    constant side."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} and {len(y)} values")
    if len(x) < 3:
        return float("nan")
    rx, ry = ranks(list(x)), ranks(list(y))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return float("nan")
    return sxy / math.sqrt(sxx * syy)


def harmonic(a: float, b: float) -> float:
    return 0.0 if a + b == 0 else 2 * a * b / (a + b)


def reproduced(published: float, measured: Optional[float]) -> Optional[bool]:
    """Issue 31's rule: the same sign, and within a factor of two of the published size. None: not measured."""
    if measured is None or not math.isfinite(measured):
        return None
    if published == 0:
        return abs(measured) < 1.0
    return (published > 0) == (measured > 0) and 0.5 <= abs(measured) / abs(published) <= 2.0


# ---------------------------------------------------------------------------
# the two sides as one shape: setting -> method -> value
# ---------------------------------------------------------------------------

# A setting: ("fewshot", shots) with metric top1; ("base2new", metric); ("cross_dataset" | "domain_shift",
# "source" | "targets").
Table = dict[tuple, dict[str, float]]


@dataclass
class Published:
    values: Table = field(default_factory=dict)
    sources: dict[tuple, dict[str, str]] = field(default_factory=dict)

    def put(self, setting: tuple, method: str, value: float, source: str) -> None:
        # Two sources for one setting (a method re-run by another paper): keep the first, as results.csv lists
        # the original paper's row first.
        if method not in self.values.setdefault(setting, {}):
            self.values[setting][method] = value
            self.sources.setdefault(setting, {})[method] = source


def published_side(rows: Optional[Iterable[PublishedRow]] = None) -> Published:
    """The published numbers by setting and method (ViT-B/16 averages; cross-dataset: ViT-B/16 trained on
    ImageNet, the ten other datasets' mean as the targets; domain shift: RN50 ImageNet family)."""
    rows = list(rows if rows is not None else load_table())
    out = Published()
    for method, by_ds, source in _transfer_rows(rows, "cross_dataset", PUBLISHED_BACKBONE):
        _put_transfer(out, "cross_dataset", method, by_ds, CROSS_DATASET_TARGETS, source)
    for method, by_ds, source in _transfer_rows(rows, "domain_shift", DOMAIN_SHIFT_BACKBONE):
        _put_transfer(out, "domain_shift", method, by_ds, DOMAIN_SHIFT_TARGETS, source)
    for r in rows:
        if r.backbone == PUBLISHED_BACKBONE and r.dataset == AVERAGE:
            if r.protocol == "fewshot":
                for k in (FEWSHOT_SHOTS if r.shots == 0 else (r.shots,)):
                    out.put(("fewshot", k), r.method, r.value, r.source)
            elif r.protocol == "base2new":
                out.put(("base2new", r.metric), r.method, r.value, r.source)
    return out


def _transfer_rows(rows: Sequence[PublishedRow], protocol: str, backbone: str):
    """(method, test set -> value, source) of one transfer protocol's rows trained on ImageNet, the first
    source's rows of each method (a later paper's re-run of the method is not mixed into its row)."""
    by_method: dict[str, dict[str, float]] = {}
    src: dict[str, str] = {}
    for r in rows:
        if r.backbone == backbone and r.protocol == protocol and r.train_dataset == "imagenet":
            if src.setdefault(r.method, r.source) == r.source:
                by_method.setdefault(r.method, {})[r.dataset] = r.value
    return [(m, v, src[m]) for m, v in by_method.items()]


def _put_transfer(out: Published, protocol: str, method: str, by_ds: Mapping[str, float],
                  targets: Sequence[str], source: str) -> None:
    if "imagenet" in by_ds:
        out.put((protocol, "source"), method, by_ds["imagenet"], source)
    if all(t in by_ds for t in targets):
        out.put((protocol, "targets"), method, sum(by_ds[t] for t in targets) / len(targets), source)
    elif AVERAGE in by_ds:  # a source that gives the targets' mean only
        out.put((protocol, "targets"), method, by_ds[AVERAGE], source)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def measured_side(runs: Iterable) -> tuple[Table, dict[str, list[str]]]:
    """Sweep runs (``fewclip.report.runs.RunResult``) -> (setting -> method -> value, notes). A backbone's value
    for a method is its mean over the tasks it ran on (seed means first); the value is the mean over backbones
    of the methods every listed backbone ran."""
    per_bb, notes = per_backbone_side(runs)
    return mean_over_backbones(per_bb), notes


def per_backbone_side(runs: Iterable) -> tuple[dict[str, Table], dict[str, list[str]]]:
    """Sweep runs -> (backbone -> setting -> method -> value, notes): each backbone's value for a method is its
    mean over the tasks it ran on (seed means first), H the harmonic mean of its averaged base and new."""
    runs = list(runs)
    notes: dict[str, list[str]] = {}
    # A method run with a preset (``gda[base2new]``: its authors' settings for the protocol, as the sweep chose)
    # is compared as the method, unless the method also ran on fewclip's defaults there (that run is compared).
    plain = {(r.protocol, r.backbone, r.method) for r in runs}
    as_preset, left_out = set(), set()
    # (protocol, backbone, method, shots, dataset) -> metric -> [seed values]
    cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        name, preset = parse_label(r.method)
        if preset != FEWCLIP:
            if (r.protocol, r.backbone, name) in plain:
                left_out.add(f"{r.method} ({r.protocol}, {r.backbone}): {name} ran on fewclip's defaults there")
                continue
            as_preset.add(f"{r.method} ({r.protocol})")
        key = (r.protocol, r.backbone, name, r.shots, r.dataset)
        if r.protocol == "fewshot":
            cells[key]["top1"].append(r.top1)
        elif r.protocol == "base2new":
            for m in ("base", "new"):
                if r.evals.get(m) is not None:
                    cells[key][m].append(r.evals[m])
        elif r.protocol in TRANSFER_PROTOCOLS:
            targets = [v for k, v in r.evals.items() if k != "source" and v is not None]
            if r.evals.get("source") is not None:
                cells[key]["source"].append(r.evals["source"])
            if targets:
                cells[key]["targets"].append(_mean(targets))
    # per backbone: setting -> method -> value
    per_bb: dict[str, Table] = defaultdict(lambda: defaultdict(dict))
    grouped: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (protocol, bb, method, shots, ds), metrics in cells.items():
        for m, vals in metrics.items():
            grouped[(protocol, bb, method, shots, m)][ds].append(_mean(vals))
    # The tasks each backbone's zero-shot ran on, per protocol: a method counts where it ran on all of them (a
    # sweep still running, or a failed run, leaves it out instead of averaging it over other tasks).
    tasks = {(p, bb): set(by_ds) for (p, bb, method, shots, m), by_ds in grouped.items() if method == ZS}
    for (protocol, bb, method, shots, m), by_ds in grouped.items():
        need = tasks.get((protocol, bb))
        if need is not None and not need <= set(by_ds):
            notes.setdefault("incomplete", []).append(f"{bb} {protocol} {method} {shots} shots: "
                                                      f"{len(set(by_ds) & need)} of {len(need)} tasks")
            continue
        v = _mean([by_ds[d][0] for d in (need or by_ds)])
        if protocol == "fewshot":
            for k in (FEWSHOT_SHOTS if shots == 0 else (shots,)):
                per_bb[bb][("fewshot", k)][method] = v
        elif protocol == "base2new":
            per_bb[bb][("base2new", m)][method] = v
        elif protocol in TRANSFER_PROTOCOLS:
            per_bb[bb][(protocol, m)][method] = v
    for bb, table in per_bb.items():  # H from the averaged base and new, per backbone
        base, new = table.get(("base2new", "base"), {}), table.get(("base2new", "new"), {})
        for method in set(base) & set(new):
            table[("base2new", "hm")][method] = harmonic(base[method], new[method])
    notes["backbones"] = sorted(per_bb)
    notes["presets"] = sorted(as_preset)
    notes["presets_left_out"] = sorted(left_out)
    return {bb: dict(t) for bb, t in sorted(per_bb.items())}, notes


def mean_over_backbones(per_bb: Mapping[str, Table]) -> Table:
    """The mean over backbones of the methods every backbone ran; H from the averaged base and new."""
    out: Table = {}
    if not per_bb:
        return out
    settings = {s for t in per_bb.values() for s in t}
    for s in settings:
        methods = set.intersection(*[set(t.get(s, {})) for t in per_bb.values()])
        if s[0] == "base2new" and s[1] == "hm":
            continue
        out[s] = {m: _mean([t[s][m] for t in per_bb.values()]) for m in methods}
    base, new = out.get(("base2new", "base"), {}), out.get(("base2new", "new"), {})
    if base and new:
        out[("base2new", "hm")] = {m: harmonic(base[m], new[m]) for m in set(base) & set(new)}
    return out


# ---------------------------------------------------------------------------
# correlations per setting and the findings
# ---------------------------------------------------------------------------


@dataclass
class Correlation:
    setting: str
    methods: list[str]
    rho: float


def correlations(pub: Table, got: Table) -> list[Correlation]:
    out = []

    def one(label: str, setting: tuple, drop: Sequence[str] = ()) -> None:
        # A transductive variant (``zeroshot+transclip``) scores with the test set's images: finding 8 compares it
        # with zero-shot; it is not ranked among the inductive methods the papers' tables hold.
        methods = sorted(m for m in set(pub.get(setting, {})) & set(got.get(setting, {}))
                         if m not in drop and "+" not in m)
        rho = spearman([pub[setting][m] for m in methods], [got[setting][m] for m in methods])
        out.append(Correlation(label, methods, rho))

    for k in FEWSHOT_SHOTS:
        one(f"few-shot, {k} shot{'s' if k > 1 else ''}", ("fewshot", k))
    for k in FEWSHOT_SHOTS:
        one(f"few-shot, {k} shot{'s' if k > 1 else ''}, without zero-shot and the linear probe", ("fewshot", k),
            NOT_BASELINES)
    for m in ("base", "new", "hm"):
        one(f"base-to-novel, {m}", ("base2new", m))
    for m in ("source", "targets"):
        one(f"cross-dataset, {m}", ("cross_dataset", m))
    for m in ("source", "targets"):
        one(f"domain shift (RN50 published), {m}", ("domain_shift", m))
    return out


@dataclass
class Finding:
    number: int
    text: str
    published: list[Optional[float]]  # the effect(s), published
    measured: list[Optional[float]]
    verdict: Optional[bool]  # None: not measured (or not published)
    note: str = ""


def _get(t: Table, setting: tuple, method: str) -> Optional[float]:
    return t.get(setting, {}).get(method)


def _diff(t: Table, setting: tuple, a: str, b: str) -> Optional[float]:
    x, y = _get(t, setting, a), _get(t, setting, b)
    return None if x is None or y is None else x - y


def _crossing(t: Table) -> Optional[float]:
    """The fewest shots at which the linear probe reaches zero-shot; inf when it is still below at 4 shots (the
    finding's range) and at every shot count measured; None when that cannot be told (4 shots not measured)."""
    seen = set()
    for k in FEWSHOT_SHOTS:
        lp, zs = _get(t, ("fewshot", k), "linear_probe"), _get(t, ("fewshot", k), ZS)
        if lp is None or zs is None:
            continue
        seen.add(k)
        if lp >= zs:
            return float(k)
    return float("inf") if 4 in seen else None


PROMPT_METHODS = ("coop", "cocoop", "kgcoop", "maple", "promptsrc")


def findings(pub: Table, got: Table) -> list[Finding]:
    """Issue 31's findings 1-9, each with the published and measured effects."""
    b2n = lambda m: ("base2new", m)  # noqa: E731
    specs: list[tuple[int, str, Callable[[Table], list[Optional[float]]], str]] = [
        (1, "CoOp's new-class accuracy falls below zero-shot (base-to-novel new: CoOp - zero-shot)",
         lambda t: [_diff(t, b2n("new"), "coop", ZS)], ""),
        (2, "CoCoOp wins much of it back (new: CoCoOp - CoOp)",
         lambda t: [_diff(t, b2n("new"), "cocoop", "coop")], ""),
        (3, "KgCoOp, MaPLe, PromptSRC beat CoOp on H (H: each - CoOp)",
         lambda t: [_diff(t, b2n("hm"), m, "coop") for m in ("kgcoop", "maple", "promptsrc")], ""),
        (4, "learned prompts score lower on new than on base classes (new - base: CoOp, CoCoOp, KgCoOp, MaPLe, "
            "PromptSRC)",
         lambda t: [_diff_metric(t, m) for m in PROMPT_METHODS], ""),
        (5, "Tip-Adapter-F beats CoOp at 1 / 2 / 4 shots (Tip-F - CoOp)",
         lambda t: [_diff(t, ("fewshot", k), "tip_adapter_f", "coop") for k in (1, 2, 4)], ""),
        (6, "LP++ beats CoOp at 1 shot (LP++ - CoOp)",
         lambda t: [_diff(t, ("fewshot", 1), "lpp", "coop")], ""),
        (7, "the linear probe reaches zero-shot at 2-4 shots (the fewest shots where it does)",
         lambda t: [_crossing(t)], ""),
        (8, "TransCLIP adds about +5 points on top of zero-shot (zero-shot+TransCLIP - zero-shot)",
         lambda t: [_diff(t, ("fewshot", 1), "zeroshot+transclip", ZS)],
         "published: TransCLIP's 11-dataset average in StatA's README minus the first zero-shot row of results.csv "
         "(65.36); StatA's own zero-shot row, 65.2, gives +5.1"),
        (9, "CoOp beats zero-shot on the domain-shift source and on its targets (CoOp - zero-shot; RN50)",
         lambda t: [_diff(t, ("domain_shift", "source"), "coop", ZS),
                    _diff(t, ("domain_shift", "targets"), "coop", ZS)], ""),
    ]
    out = []
    for number, text, effect, note in specs:
        p, m = effect(pub), effect(got)
        if number == 7:
            verdict = None if m[0] is None or p[0] is None else (m[0] in (2.0, 4.0))
        elif any(x is None for x in p):
            verdict = None
        else:
            vs = [reproduced(a, b) for a, b in zip(p, m)]
            verdict = None if any(v is None for v in vs) else all(vs)
        out.append(Finding(number, text, p, m, verdict, note))
    return out


def _diff_metric(t: Table, method: str) -> Optional[float]:
    n, b = _get(t, ("base2new", "new"), method), _get(t, ("base2new", "base"), method)
    return None if n is None or b is None else n - b


# ---------------------------------------------------------------------------
# the printed report
# ---------------------------------------------------------------------------


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "never"
    return f"{x:+.2f}" if abs(x) < 1000 else f"{x:.0f}"


def render(pub: Published, got: Table, notes: Mapping[str, list[str]], runs_from: Sequence[str],
           per_backbone: Optional[Mapping[str, Table]] = None) -> str:
    """The printed check; with ``per_backbone`` (``per_backbone_side``), each finding's effect and verdict on
    each backbone too, and on how many it is reproduced (issue 31 asks for three of the four geometries)."""
    lines = [f"literature check: measured on {', '.join(notes.get('backbones', [])) or 'nothing'} "
             f"(runs under {', '.join(runs_from)}), against results.csv "
             f"({PUBLISHED_BACKBONE} 11-dataset averages; domain shift {DOMAIN_SHIFT_BACKBONE})", ""]
    for line in notes.get("incomplete", []):
        lines.append(f"left out (not run on every task zero-shot ran on): {line}")
    if notes.get("presets"):
        lines.append(f"compared as their method, on the preset the sweep ran: {', '.join(notes['presets'])}")
    for line in notes.get("presets_left_out", []):
        lines.append(f"left out (a preset beside the defaults): {line}")
    lines.append("## Values, published beside measured (top-1 %)")
    for setting in sorted(set(pub.values) | set(got), key=str):
        p, g = pub.values.get(setting, {}), got.get(setting, {})
        both = sorted(set(p) | set(g))
        if not (set(p) & set(g)):
            continue
        lines.append(f"{setting[0]} {setting[1]}:")
        for m in both:
            src = pub.sources.get(setting, {}).get(m, "")
            pv = f"{p[m]:6.2f}" if m in p else "     -"
            gv = f"{g[m]:6.2f}" if m in g else "     -"
            lines.append(f"  {m:24s} published {pv}  measured {gv}  {src}")
    lines += ["", "## Spearman rank correlation per setting (methods both sides have)"]
    for c in correlations(pub.values, got):
        rho = "  n/a" if not math.isfinite(c.rho) else f"{c.rho:+.2f}"
        lines.append(f"  {c.setting:70s} {rho}  over {len(c.methods)} methods")
    lines += ["", "## Findings (reproduced: same sign, within a factor of two of the published size)"]
    per_bb_findings = ({bb: findings(pub.values, t) for bb, t in per_backbone.items()}
                       if per_backbone and len(per_backbone) > 1 else {})
    for f in findings(pub.values, got):
        verdict = {True: "REPRODUCED", False: "not reproduced", None: "not measured"}[f.verdict]
        lines.append(f"  {f.number}. {f.text}")
        fmt = (lambda x: "-" if x is None else ("not in 1-16" if math.isinf(x) else f"{x:.0f} shots")) \
            if f.number == 7 else _fmt
        lines.append(f"     published {' / '.join(map(fmt, f.published))}; measured "
                     f"{' / '.join(map(fmt, f.measured))}: {verdict}" + (f" ({f.note})" if f.note else ""))
        if per_bb_findings and f.verdict is not None:
            each = {bb: found[f.number - 1] for bb, found in per_bb_findings.items()}
            told = [v for v in each.values() if v.verdict is not None]
            lines.append(f"     reproduced on {sum(bool(v.verdict) for v in told)} of {len(told)} backbones:")
            width = max(map(len, each))
            lines += [f"       {bb:{width}s}  {' / '.join(map(fmt, v.measured))}: {_MARK[v.verdict]}"
                      for bb, v in each.items()]
    return "\n".join(lines)


_MARK = {True: "yes", False: "no", None: "not measured"}


def load_sweep_runs(folders: Sequence[str | Path]) -> list:
    """Every finished run under the sweep folders that exist (``fewclip.report.runs.load_runs``)."""
    from fewclip.report.runs import load_runs

    runs = []
    for f in folders:
        if Path(f).is_dir():
            runs.extend(load_runs(f)[0])
    return runs
