"""A sweep's plan (``sweep_plan.json`` in its out folder), and the report's account of it.

``fewclip sweep`` writes the plan before its first run: every planned run's folder, its cell (protocol, backbone,
dataset, method, shots, seed) and the identity it must have (``fewclip.runs.records``); after its runs, it adds the
first line of each failed run's error. The report reads the plan of each folder it is given and accounts for
every planned run:

* finished: a run in its folder with the planned identity;
* failed: not finished, and the sweep that wrote the plan saw it fail (the first line of its error);
* missing: neither (not run yet, killed, or its folder removed);
* other config: a finished run whose identity is not the planned one (another sweep with other settings wrote
  it into the same folder), or a finished run under the folder that no plan names. Its numbers are in the
  tables, marked, so that a table never mixes configs silently.

A plan written by an older fewclip, or damaged, is ignored with a warning: the report then shows what it finds.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fewclip.data.protocols import PROTOCOLS
from fewclip.report.runs import MAX_INT, PROTOCOL_TITLES, RunResult
from fewclip.runs.plan import PLAN_FILE, PLAN_FORMAT, PLAN_VERSION, first_line, plan_folder  # noqa: F401
from fewclip.utils.io import read_json

logger = logging.getLogger(__name__)

OTHER_CONFIG = "finished with another config than the sweep plan's"
NOT_PLANNED = "not in the sweep plan"


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep plan and what became of it (``status``: finished, failed, missing, other config)."""

    protocol: str
    backbone: str
    dataset: str
    method: str
    shots: int
    seed: int
    dir: str
    identity: str
    status: str = "missing"
    error: str = ""


def plan_folders(root: Path) -> list[Path]:
    """The folders under a report's run folder that may hold a sweep's plan: it, and one per protocol."""
    return [plan_folder(root, p) for p in PROTOCOLS]


def read_plan(root: Path) -> list[PlannedRun] | None:
    """The planned runs of ``root/sweep_plan.json`` (status still "missing"), None where there is no usable one."""
    path = Path(root) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        obj = read_json(path)
        if not isinstance(obj, dict) or obj.get("format") != PLAN_FORMAT or obj.get("version") != PLAN_VERSION:
            raise ValueError(f"not a {PLAN_FORMAT} version {PLAN_VERSION} file")
        failed = obj.get("failed") or {}
        if not isinstance(failed, dict):
            raise ValueError("'failed' must map run folders to errors")
        out = []
        for r in obj["runs"]:
            fields = {k: r[k] for k in ("protocol", "backbone", "dataset", "method", "dir", "identity")}
            if not all(isinstance(v, str) for v in fields.values()):
                raise ValueError("a run's protocol, backbone, dataset, method, dir and identity must be strings")
            nums = {k: r[k] for k in ("shots", "seed")}
            if not all(isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_INT for v in nums.values()):
                raise ValueError("a run's shots and seed must be integers")
            err = failed.get(fields["dir"])
            out.append(PlannedRun(**fields, **nums, status="failed" if err else "missing",
                                  error=first_line(err) if err else ""))
        return out
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # a foreign or damaged plan
        logger.warning("ignoring %s: %s; the report shows the runs it finds, without the plan's account", path, e)
        return None


def _key(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


def account(root: Path, runs: list[RunResult], planned: list[PlannedRun]) -> tuple[list[RunResult], list[PlannedRun]]:
    """Match the runs found under ``root`` with its plan: returns the runs (those of another identity than the
    plan's, or under ``root`` but in no planned folder, get ``other_config`` set) and the planned runs with their
    status. A planned run's backbone and dataset take the names its finished runs report (a card path or
    weights file can be named otherwise in metrics.json than in the plan)."""
    by_dir = {_key(Path(root) / p.dir): p for p in planned}
    protocols = {p.protocol for p in planned}
    found: dict[str, RunResult] = {}
    names: dict[tuple[str, str], tuple[str, str]] = {}
    out_runs = []
    root_key = _key(root)
    for r in runs:
        k = _key(r.path.parent)
        p = by_dir.get(k)
        if not (k == root_key or k.startswith(root_key + os.sep)) or (p is None and r.protocol not in protocols):
            out_runs.append(r)  # not this plan's: another folder merged into the report, or another protocol's
            continue
        if p is None:
            out_runs.append(dataclasses.replace(r, other_config=NOT_PLANNED))
            continue
        if "+" not in r.method or r.method == p.method:
            found[k] = r
            names[(p.backbone, p.dataset)] = (r.backbone, r.dataset)
        out_runs.append(r if r.identity == p.identity else dataclasses.replace(r, other_config=OTHER_CONFIG))
    accounted = []
    for k, p in by_dir.items():
        bb, ds = names.get((p.backbone, p.dataset), (p.backbone, p.dataset))
        r = found.get(k)
        if r is not None:
            status, error = ("finished", "") if r.identity == p.identity else ("other config", "")
        else:
            status, error = p.status, p.error
        accounted.append(dataclasses.replace(p, backbone=bb, dataset=ds, status=status, error=error))
    return out_runs, accounted


def unfinished_markdown(planned: Sequence[PlannedRun], backbone: str, protocol: str = "fewshot") -> list[str]:
    """``report.md``'s list of the planned runs of ``backbone`` that did not finish, per method and cell."""
    mine = [p for p in planned if p.backbone == backbone and p.protocol == protocol
            and p.status in ("failed", "missing")]
    if not mine:
        return []
    where = "" if protocol == "fewshot" else f" ({PROTOCOL_TITLES.get(protocol, protocol)})"
    out = [f"### Planned runs that did not finish, `{backbone}`{where}", ""]
    cells: dict[tuple, list[PlannedRun]] = {}
    for p in sorted(mine, key=lambda p: (p.method, p.dataset, p.shots, p.seed)):
        cells.setdefault((p.method, p.dataset, p.shots), []).append(p)
    total = {}
    for p in planned:
        if p.backbone == backbone and p.protocol == protocol:
            total[(p.method, p.dataset, p.shots)] = total.get((p.method, p.dataset, p.shots), 0) + 1
    for (method, ds, shots), ps in cells.items():
        failed = [p for p in ps if p.status == "failed"]
        missing = [p for p in ps if p.status == "missing"]
        parts = []
        if failed:
            errors: dict[str, list[int]] = {}  # the same error in every seed is said once
            for p in failed:
                errors.setdefault(p.error, []).append(p.seed)
            parts.append(f"{len(failed)} failed (" + "; ".join(
                f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}: {_one_line(e)}"
                for e, seeds in errors.items()) + ")")
        if missing:
            parts.append(f"{len(missing)} missing (seed {', '.join(str(p.seed) for p in missing)})")
        out.append(f"- `{_one_line(method)}` on {_one_line(ds)} at {shots} shots: {len(ps)} of "
                   f"{total[(method, ds, shots)]} planned runs did not finish: " + ", ".join(parts))
    out.append("")
    return out


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def plan_json(planned: Sequence[PlannedRun]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(p) for p in planned]
