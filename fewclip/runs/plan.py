"""A sweep's plan (``sweep_plan.json`` in its out folder): written by ``fewclip sweep`` before its first run, with
every planned run's folder, cell and identity, and after its runs with the first line of each failed run's error.
The report reads it back and accounts for every planned run (``fewclip.report.plan``)."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from fewclip.utils.io import atomic_write_json, read_json

logger = logging.getLogger(__name__)

FEWSHOT = "fewshot"
PLAN_FILE = "sweep_plan.json"
PLAN_FORMAT = "fewclip.sweep_plan"
PLAN_VERSION = 1


def first_line(message: str) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def plan_folder(out: Path, protocol: str = FEWSHOT) -> Path:
    """Where a sweep of ``protocol`` keeps its plan: its out folder, or ``OUT/<protocol>/`` (where its runs are)."""
    return Path(out) if protocol == FEWSHOT else Path(out) / protocol


def new_plan(runs: Sequence[dict], identities: Sequence[str], protocol: str = FEWSHOT) -> dict:
    """The plan of a sweep: ``runs`` as ``fewclip.runs.sweep.plan_sweep`` gives them (folders relative to its out
    folder), with each one's identity; folders are kept relative to :func:`plan_folder`."""
    base = Path() if protocol == FEWSHOT else Path(protocol)
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "sweep": uuid.uuid4().hex, "protocol": protocol,
            "runs": [{"protocol": r["protocol"], "backbone": r["backbone"], "dataset": r["dataset"],
                      "method": r["method"], "shots": int(r["shots"]), "seed": int(r["seed"]),
                      "dir": Path(r["dir"]).relative_to(base).as_posix(), "identity": ident}
                     for r, ident in zip(runs, identities)],
            "failed": {}}


def write_plan(out: Path, plan: dict) -> Path:
    return atomic_write_json(Path(out) / PLAN_FILE, plan)


def record_failures(out: Path, plan: dict, failures: Iterable[tuple[str, str]]) -> None:
    """Add ``(dir, error)`` of the sweep's failed runs to its plan, unless another sweep has since written its own
    plan there (call under the sweep lock)."""
    try:
        current = read_json(Path(out) / PLAN_FILE)
    except (OSError, ValueError, RecursionError):
        current = None
    if not isinstance(current, dict) or current.get("sweep") != plan["sweep"]:
        logger.info("%s: another sweep has written its plan since; this sweep's failures are in its output only",
                    out)
        return
    base = Path() if plan.get("protocol", FEWSHOT) == FEWSHOT else Path(plan["protocol"])
    plan = {**plan, "failed": {Path(d).relative_to(base).as_posix(): first_line(e) for d, e in failures}}
    write_plan(out, plan)
