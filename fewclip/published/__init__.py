"""Published results of the methods fewclip has, shipped as data, and ``fewclip published`` to list them.

``results.csv`` holds one row per published number::

    method,backbone,dataset,protocol,shots,metric,value,source,note,train_dataset

* ``method``: fewclip's registered name (``coop``, ``tip_adapter_f``, ``lora`` for CLIP-LoRA, ...);
* ``backbone``: the open_clip architecture and tag (``ViT-B-16/openai``); ``backbones.csv`` gives the sha256
  of each one's published weights file, so a run on a local copy of that file matches too;
* ``dataset``: fewclip's dataset name (``caltech101``, ``oxford_pets``, ...), or ``average`` for the mean over
  the 11 datasets of CoOp's benchmark (``ELEVEN``); under ``domain_shift``/``cross_dataset`` the test set,
  with ``train_dataset`` the dataset trained on (a ``cross_dataset`` ``average`` row trained on ``imagenet``:
  the mean over the ten other datasets, CoCoOp's Table 2 average);
* ``protocol``: fewclip's protocol names (``fewshot``, ``base2new``, ``cross_dataset``, ``domain_shift``);
* ``shots`` (0 for zero-shot), ``metric`` (``top1``; ``base``, ``new``, ``hm`` under base2new), ``value`` (%);
* ``source``: ``owner/repo@commit:path (table)``, the file the number was read from; ``note``: what the row
  is (seeds, configuration, what the source says of the backbone).

Two sources may give different numbers for one setting (a method re-run by another paper, two configurations of
IVLP): both rows are kept, each with its source. Torch-free: ``fewclip published`` starts in a fraction of a second.
"""
from __future__ import annotations

import csv
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Optional

from fewclip.utils.errors import InputError

HERE = Path(__file__).resolve().parent
RESULTS_FILE = HERE / "results.csv"
BACKBONES_FILE = HERE / "backbones.csv"
COLUMNS = ("method", "backbone", "dataset", "protocol", "shots", "metric", "value", "source", "note", "train_dataset")
PROTOCOLS = ("fewshot", "base2new", "cross_dataset", "domain_shift")  # fewclip.data.protocols.PROTOCOLS (torch-free copy)
METRICS = {"fewshot": ("top1",), "base2new": ("base", "new", "hm"), "cross_dataset": ("top1",),
           "domain_shift": ("top1",)}
AVERAGE = "average"
# The 11 datasets of CoOp's benchmark, by fewclip's names: an ``average`` row is their mean.
ELEVEN = ("imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101", "fgvc_aircraft",
          "sun397", "dtd", "eurosat", "ucf101")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class PublishedError(InputError):
    """A malformed published-results table, or a bad ``fewclip published`` option."""


@dataclass(frozen=True)
class PublishedRow:
    method: str
    backbone: str
    dataset: str
    protocol: str
    shots: int
    metric: str
    value: float
    source: str
    note: str = ""
    train_dataset: str = ""


def _parse_row(raw: dict[str, str], where: str) -> PublishedRow:
    missing = [c for c in COLUMNS if not (raw.get(c) or "").strip() and c not in ("note", "train_dataset")]
    if missing:
        raise PublishedError(f"{where}: empty {', '.join(missing)}; every row needs a value and its source")
    try:
        shots, value = int(raw["shots"]), float(raw["value"])
    except ValueError:
        raise PublishedError(f"{where}: shots must be an integer and value a number, got {raw['shots']!r}, "
                             f"{raw['value']!r}") from None
    row = PublishedRow(**{c: (raw.get(c) or "").strip() for c in COLUMNS if c not in ("shots", "value")},
                       shots=shots, value=value)
    if row.protocol not in PROTOCOLS:
        raise PublishedError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {row.protocol!r}")
    if row.metric not in METRICS[row.protocol]:
        raise PublishedError(f"{where}: metric under {row.protocol} must be one of "
                             f"{', '.join(METRICS[row.protocol])}, got {row.metric!r}")
    if not (math.isfinite(value) and 0.0 <= value <= 100.0) or shots < 0:
        raise PublishedError(f"{where}: value must be a percentage in [0, 100] and shots >= 0, got {value}, {shots}")
    if "/" not in row.backbone:
        raise PublishedError(f"{where}: backbone must be an open_clip ARCH/TAG, got {row.backbone!r}")
    return row


def load_table(path: str | Path | None = None) -> list[PublishedRow]:
    """The rows of a published-results CSV (default: the one shipped with fewclip), checked."""
    path = Path(path or RESULTS_FILE)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != COLUMNS:
                raise PublishedError(f"{path}: the header must be {','.join(COLUMNS)}, got {reader.fieldnames}")
            rows = [_parse_row(raw, f"{path} line {i}") for i, raw in enumerate(reader, start=2)]
    except OSError as e:
        raise PublishedError(f"cannot read the published-results table {path}: {e.strerror or e}") from None
    seen: dict[PublishedRow, int] = {}
    for i, r in enumerate(rows, start=2):
        if r in seen:
            raise PublishedError(f"{path} line {i}: a duplicate of line {seen[r]}")
        seen[r] = i
    return rows


@lru_cache(maxsize=1)
def shipped_table() -> tuple:
    return tuple(load_table())


@lru_cache(maxsize=1)
def backbone_checksums() -> dict[str, str]:
    """sha256 of a published weights file -> its open_clip ARCH/TAG (``backbones.csv``)."""
    with BACKBONES_FILE.open(newline="", encoding="utf-8") as f:
        return {r["sha256"]: r["backbone"] for r in csv.DictReader(f)}


def backbone_key(name: str, sha256: Optional[str] = None) -> str:
    """The published-table name of a run's backbone: by its weights' sha256 where that is a published file's,
    else its open_clip ``ARCH/TAG`` with ``-quickgelu`` dropped (OpenAI's weights load as ``ViT-B-16-quickgelu``)."""
    if sha256 and sha256 in backbone_checksums():
        return backbone_checksums()[sha256]
    arch, slash, tag = name.partition("/")
    return re.sub(r"-quickgelu$", "", arch) + slash + tag


def filter_rows(rows: Sequence[PublishedRow], method: Sequence[str] = (), dataset: Sequence[str] = (),
                protocol: Sequence[str] = (), backbone: Sequence[str] = (), shots: Sequence[int] = (),
                metric: Sequence[str] = ()) -> list[PublishedRow]:
    """The rows whose fields are among the given values (an empty list keeps every value). Backbones compare by
    :func:`backbone_key`, so ``ViT-B-16-quickgelu/openai`` or a weights sha256 finds ``ViT-B-16/openai``."""
    want_bb = {backbone_key(b, b if _SHA256.fullmatch(b) else None) for b in backbone}
    return [r for r in rows
            if (not method or r.method in method) and (not dataset or r.dataset in dataset)
            and (not protocol or r.protocol in protocol) and (not want_bb or r.backbone in want_bb)
            and (not shots or r.shots in shots) and (not metric or r.metric in metric)]


# ---------------------------------------------------------------------------
# fewclip published


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PublishedOptions:
    method: list[str] = field(default_factory=list, metadata=_help(
        "only these methods, by fewclip's names (coop, tip_adapter_f, lora, ...); comma-separated or [a,b]"))
    dataset: list[str] = field(default_factory=list, metadata=_help(
        "only these datasets (fewclip's names, or average: the mean over the 11 datasets)"))
    protocol: list[str] = field(default_factory=list, metadata=_help(
        f"only these protocols: {', '.join(PROTOCOLS)} (few_shot is read as fewshot)"))
    backbone: list[str] = field(default_factory=list, metadata=_help(
        "only these backbones: open_clip ARCH/TAG (ViT-B-16/openai; -quickgelu is ignored) or a weights sha256"))
    shots: list[int] = field(default_factory=list, metadata=_help("only these shots (0: zero-shot)"))
    metric: list[str] = field(default_factory=list, metadata=_help("only these metrics: top1, base, new, hm"))
    sources: bool = field(default=True, metadata=_help("show each row's source (file and table) and note"))


USAGE = ("usage: fewclip published [method=NAME[,NAME]] [dataset=NAME] [protocol=NAME] [backbone=ARCH/TAG] "
         "[shots=N] [metric=NAME] [sources=false]: the published results shipped with fewclip, with their sources")


def parse_options(args: Sequence[str]) -> PublishedOptions:
    """``key=value`` arguments into :class:`PublishedOptions` (lists: ``a,b`` or ``[a,b]``)."""
    kinds = {f.name: f for f in fields(PublishedOptions)}
    values: dict[str, object] = {}
    for a in args:
        key, eq, value = a.partition("=")
        if not eq or key not in kinds:
            raise PublishedError(f"unknown argument {a!r}: expected one of {', '.join(k + '=' for k in kinds)}; "
                                 f"{USAGE}")
        if key == "sources":
            if value.lower() not in ("true", "false"):
                raise PublishedError(f"sources must be true or false, got {value!r}")
            values[key] = value.lower() == "true"
            continue
        items = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if key == "shots":
            try:
                items = [int(v) for v in items]
            except ValueError:
                raise PublishedError(f"shots must be integers, got {value!r}") from None
        if key == "protocol":
            items = ["fewshot" if v == "few_shot" else v for v in items]
            bad = [v for v in items if v not in PROTOCOLS]
            if bad:
                raise PublishedError(f"protocol must be among {', '.join(PROTOCOLS)}, got {', '.join(bad)}")
        values[key] = list(values.get(key, [])) + items  # type: ignore[arg-type]
    return PublishedOptions(**values)  # type: ignore[arg-type]


def display_dataset(row: PublishedRow) -> str:
    """The row's test set, with what it was trained on where that differs (transfer protocols)."""
    if not row.train_dataset:
        return row.dataset
    return f"{row.dataset} (source)" if row.dataset == row.train_dataset else f"{row.dataset} (from {row.train_dataset})"


def render(rows: Sequence[PublishedRow], sources: bool = True) -> str:
    """A plain-text table of the rows (the CLI's output)."""
    cols = ["method", "backbone", "dataset", "protocol", "shots", "metric", "value"] + (
        ["source", "note"] if sources else [])
    cells = [[str(getattr(r, c)) if c != "value" else f"{r.value:.2f}" for c in cols] for r in rows]
    for r, line in zip(rows, cells):
        if r.train_dataset:
            line[cols.index("dataset")] = display_dataset(r)
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells]
    return "\n".join(out)


def command(args: Sequence[str]) -> int:
    """``fewclip published [key=value ...]``: the shipped table, filtered."""
    opts = parse_options(args)
    rows = filter_rows(shipped_table(), opts.method, opts.dataset, opts.protocol, opts.backbone, opts.shots,
                       opts.metric)
    rows.sort(key=lambda r: (r.method, r.backbone, r.protocol, r.train_dataset, r.dataset, r.shots))  # stable: metric order kept
    if not rows:
        print("no published result matches; `fewclip published` alone lists them all", file=sys.stderr)
        return 0
    print(render(rows, opts.sources))
    transfer = any(r.dataset == AVERAGE and r.train_dataset for r in rows)
    print(f"\n{len(rows)} published result(s); values in %; average = mean over the 11 datasets "
          f"({', '.join(ELEVEN)})" + ("; average (from X): over the ten others, X's targets" if transfer else ""))
    return 0
