"""Reading a run directory's finished runs (``metrics.json`` files) for the report."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fewclip.data.protocols import PROTOCOLS, TRANSFER_PROTOCOLS
from fewclip.runs.records import run_state
from fewclip.utils.errors import InputError
from fewclip.utils.io import read_json

logger = logging.getLogger(__name__)


ZEROSHOT = "zeroshot"
AVERAGE = "average"
METRICS_FILE = "metrics.json"
FIGURE_FILE = "accuracy_vs_shots.png"
COST_FIGURE_FILE = "cost_vs_accuracy.png"
# Cost columns: metrics.json key -> header.
COST_COLUMNS = {
    "trainable_parameters": "Trainable params",
    "train_time_s": "Train time (s)",
    "wall_time_s": "Wall time (s)",
    "images_encoded": "Images encoded",
    "peak_memory_mib": "Peak memory (MiB)",
}
CSV_COLUMNS = (
    "backbone", "dataset", "method", "shots", "mean", "std", "ci95", "n",
    "delta_zeroshot", "seeds", "datasets", "protocol", "eval",
    # added later, after the columns above (readers by position keep working)
    "mean_per_class", "mean_per_class_std", "mean_per_class_ci95", "mean_per_class_n", "majority", "chance",
    "planned", "failed", "missing", "other_config", "unrecorded",
)
FEWSHOT = "fewshot"
NA = "n/a"
MAX_INT = 2**31 - 1  # shots and seeds beyond this are not a run's: such a file is skipped
PROTOCOL_TITLES = {
    "base2new": "Base-to-novel generalisation",
    "cross_dataset": "Cross-dataset transfer",
    "domain_shift": "Domain generalisation",
}


class NoRunsFoundError(InputError):
    """``fewclip report`` found no usable ``metrics.json`` under the run root."""



@dataclass(frozen=True)
class RunResult:
    """One run: the fields of its ``metrics.json`` that the report uses."""

    method: str
    dataset: str
    backbone: str
    shots: int
    seed: int
    top1: float
    path: Path
    # Cost (None where metrics.json does not record it); peak_memory_mib is the CUDA peak on a GPU, else RSS.
    trainable_parameters: float | None = None
    train_time_s: float | None = None
    wall_time_s: float | None = None
    images_encoded: float | None = None
    peak_memory_mib: float | None = None
    memory: str | None = None  # "cuda" or "rss"
    protocol: str = FEWSHOT
    # Under a protocol other than fewshot: test set name -> top-1, None where the method could not score it.
    evals: dict = field(default_factory=dict, compare=False, hash=False)
    # The fewest training images a class had where that was fewer than ``shots`` (data.allow_fewer_shots);
    # None: every class had ``shots``.
    fewest_shots: int | None = field(default=None, compare=False)
    # Mean per-class accuracy (balanced accuracy, %): metrics.json's ``mean_per_class``, else the mean of its
    # ``per_class``; None where neither is there.
    mean_per_class: float | None = field(default=None, compare=False)
    # Accuracy of always answering the test set's largest class, and of guessing uniformly (%), where known.
    majority: float | None = field(default=None, compare=False)
    chance: float | None = field(default=None, compare=False)
    # The run's record: False for a metrics.json without one (an older fewclip, or written by hand), which the
    # report marks; ``identity`` is the record's identity digest.
    recorded: bool = field(default=True, compare=False)
    identity: str | None = field(default=None, compare=False)
    # Set from the sweep plan (``fewclip.report.plan``): why this finished run is not the run the plan holds
    # (another config, or not in the plan); empty: it is, or there is no plan.
    other_config: str = field(default="", compare=False)


@dataclass(frozen=True)
class SkippedFile:
    path: Path
    reason: str



# ----------------------------------------------------------------------------
# Reading runs


def _require(obj: dict, key: str, kind: str) -> Any:
    if key not in obj:
        raise ValueError(f"missing key {key!r}")
    value = obj[key]
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key!r} must be a non-empty string, got {value!r}")
        return value
    if kind == "int":
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value)):
            raise ValueError(f"{key!r} must be an integer, got {value!r}")
        if abs(value) > MAX_INT:  # no run has that many shots or such a seed; numpy and plots cannot hold it
            raise ValueError(f"{key!r} must be an integer of at most {MAX_INT}, got {value:.3g}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key!r} must be a finite number, got {value!r}")
    return float(value)


MAX_COST = 1e15  # no run costs more (seconds, parameters, images, MiB); beyond it a mean over runs overflows


def _cost(obj: dict, key: str) -> float | None:
    """An optional cost number; missing, or not a finite number in [0, MAX_COST]: None."""
    value = obj.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or value > MAX_COST):
        return None
    return float(value)


def _parse_evals(obj: dict, protocol: str) -> dict:
    """A protocol run's test set -> top-1 (None: n/a), checked."""
    evals = obj.get("evals")
    if not isinstance(evals, dict) or not evals:
        raise ValueError(f"protocol {protocol!r}: 'evals' must map each test set to its accuracy")
    out: dict = {}
    for name, e in evals.items():
        if not isinstance(e, dict) or "top1" not in e:
            raise ValueError(f"evals[{name!r}] must be an object with 'top1' (a number, or null for n/a)")
        top1 = e["top1"]
        if top1 is not None:
            top1 = _require(e, "top1", "float")
            if not 0.0 <= top1 <= 100.0:
                raise ValueError(f"evals[{name!r}].top1 is a percentage in [0, 100], got {top1}")
        out[str(name)] = top1
    need = {"base", "new"} if protocol == "base2new" else {"source"}
    if not need <= set(out) or (protocol in TRANSFER_PROTOCOLS and len(out) < 2):
        raise ValueError(f"protocol {protocol!r}: 'evals' must hold {' and '.join(sorted(need))}"
                         + (" and at least one target" if protocol in TRANSFER_PROTOCOLS else "")
                         + f", got {sorted(out)}")
    if out.get("hm") is not None or AVERAGE in out:
        raise ValueError(f"'hm' and {AVERAGE!r} are names of derived cells, not test sets")
    return out


def _fewest_shots(obj: dict) -> int | None:
    """The fewest training images of a class (``shots_per_class``) where fewer than ``shots``, else None."""
    per_class = obj.get("shots_per_class")
    if not isinstance(per_class, dict) or not per_class:
        return None
    counts = [v for v in per_class.values() if isinstance(v, int) and not isinstance(v, bool)]
    fewest = min(counts) if counts else None
    return fewest if fewest is not None and fewest < obj.get("shots", 0) else None


def _percent(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if 0.0 <= value <= 100.0 else None


def _class_numbers(obj: dict, suffix: str = "") -> dict:
    """``mean_per_class`` (balanced accuracy), ``majority`` and ``chance`` (%) of a run's metrics, each None where
    the file does not give what it needs: ``mean_per_class`` is recorded by fewclip since it computes it, else the
    mean of ``per_class`` over the classes with test images; ``majority`` needs ``n_test_per_class``; ``chance``
    is 100 / the number of classes."""
    per_class = obj.get(f"per_class{suffix}")
    values = [v for v in (per_class.values() if isinstance(per_class, dict) else ()) if _percent(v) is not None]
    mean = _percent(obj.get(f"mean_per_class{suffix}"))
    if mean is None and values:
        mean = sum(values) / len(values)
    counts = obj.get("n_test_per_class")
    counts = [v for v in counts.values() if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT] \
        if isinstance(counts, dict) else []
    majority = 100.0 * max(counts) / sum(counts) if counts and sum(counts) > 0 else None
    n_classes = len(per_class) if isinstance(per_class, dict) and per_class else None
    return {"mean_per_class": mean, "majority": majority, "chance": 100.0 / n_classes if n_classes else None}


def _parse_metrics(obj: Any, path: Path) -> RunResult:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    protocol = obj.get("protocol", FEWSHOT)
    if protocol not in PROTOCOLS:
        raise ValueError(f"'protocol' must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    evals = _parse_evals(obj, protocol) if protocol != FEWSHOT else {}
    cuda = _cost(obj, "peak_cuda_mib")
    rss = _cost(obj, "peak_rss_mib")
    run = RunResult(
        method=_require(obj, "method", "str"),
        dataset=_require(obj, "dataset", "str"),
        backbone=_require(obj, "backbone", "str"),
        shots=_require(obj, "shots", "int"),
        seed=_require(obj, "seed", "int"),
        top1=_require(obj, "top1", "float"),
        path=path,
        trainable_parameters=_cost(obj, "trainable_parameters"),
        train_time_s=_cost(obj, "train_time_s"),
        wall_time_s=_cost(obj, "wall_time_s"),
        images_encoded=_cost(obj, "images_encoded"),
        peak_memory_mib=cuda if cuda is not None else rss,
        memory="cuda" if cuda is not None else ("rss" if rss is not None else None),
        protocol=protocol,
        evals=evals,
        fewest_shots=_fewest_shots(obj),
        **_class_numbers(obj),
    )
    if run.dataset == AVERAGE:
        raise ValueError(f"'dataset' may not be {AVERAGE!r} (reserved for the average row)")
    if run.shots < 0:
        raise ValueError(f"'shots' must be >= 0, got {run.shots}")
    if not 0.0 <= run.top1 <= 100.0:
        raise ValueError(f"'top1' is a percentage in [0, 100], got {run.top1}")
    return run


def load_runs(run_root: str | Path) -> tuple[list[RunResult], list[SkippedFile]]:
    """Read every ``metrics.json`` under ``run_root``; return (runs, skipped).

    Files are read in sorted path order. A malformed file, or a second run of
    an already-seen (method, dataset, backbone, shots, seed), is skipped with
    a logged warning.
    """
    run_root = Path(run_root)
    if not run_root.is_dir():
        raise NoRunsFoundError(f"run directory {str(run_root)!r} does not exist or is not a directory; give the out= "
                               f"folder of a `fewclip sweep` or `fewclip train`")
    runs: list[RunResult] = []
    skipped: list[SkippedFile] = []
    seen: dict[tuple, Path] = {}
    for path in metrics_files(run_root):
        try:
            obj = read_json(path)
            run = _parse_metrics(obj, path)
        except RecursionError:  # JSON nested deeper than Python's parser goes: no run writes that
            logger.warning("skipping malformed %s: JSON nested too deeply to read", path)
            skipped.append(SkippedFile(path, "malformed: JSON nested too deeply to read"))
            continue
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            logger.warning("skipping malformed %s: %s", path, e)
            skipped.append(SkippedFile(path, f"malformed: {e}"))
            continue
        state = run_state(path.parent)
        if state.kind == "modified":  # a record that no longer vouches for the files (no record: older runs)
            logger.warning("skipping %s: %s", path, state.reason)
            skipped.append(SkippedFile(path, f"not a valid finished run: {state.reason}"))
            continue
        record = obj.get("run_record")
        run = dataclasses.replace(run, recorded=state.kind != "legacy",
                                  identity=record.get("identity") if isinstance(record, dict) else None)
        key = (run.protocol, run.method, run.dataset, run.backbone, run.shots, run.seed)
        if key in seen:
            logger.warning("skipping %s: duplicate of %s (protocol, method, dataset, backbone, shots, seed = %s)",
                           path, seen[key], key)
            skipped.append(SkippedFile(path, f"duplicate of {seen[key]}"))
            continue
        if run.method == ZEROSHOT and run.shots != 0:
            logger.warning("%s: method %r with shots=%d is not used as the zero-shot baseline "
                           "(that is shots=0)", path, ZEROSHOT, run.shots)
        seen[key] = path
        runs.append(run)
        runs.extend(_transductive_rows(run, obj))
    return runs, skipped


def metrics_files(run_root: Path) -> list[Path]:
    """Every ``metrics.json`` under ``run_root``, in sorted path order, following symlinked folders (a run folder
    linked in from elsewhere is a run of this tree) but entering each real folder once, so a link cycle ends."""
    found: list[Path] = []
    visited: set[str] = set()
    for folder, dirs, files in os.walk(run_root, followlinks=True):
        real = os.path.realpath(folder)
        if real in visited:
            dirs[:] = []
            continue
        visited.add(real)
        dirs.sort()
        if METRICS_FILE in files and (Path(folder) / METRICS_FILE).is_file():
            found.append(Path(folder) / METRICS_FILE)
    return sorted(found)


def _transductive_rows(run: RunResult, obj: dict) -> list[RunResult]:
    """A run scored a second time by a transductive plug-in (metrics.json ``transductive``: its name, and
    ``top1_<name>`` beside ``top1``, per test set too) as a method of its own, ``<method>+<name>``, so that it gets
    its own rows in every table and plot."""
    mode = obj.get("transductive")
    if not isinstance(mode, str) or not isinstance(obj.get(f"top1_{mode}"), (int, float)):
        return []
    evals = {k: (v.get(f"top1_{mode}") if isinstance(v, dict) else None) for k, v in (obj.get("evals") or {}).items()}
    return [dataclasses.replace(run, method=f"{run.method}+{mode}", top1=float(obj[f"top1_{mode}"]),
                                evals=evals if run.protocol != FEWSHOT else {},
                                mean_per_class=_class_numbers(obj, f"_{mode}")["mean_per_class"])]


# ----------------------------------------------------------------------------
# Aggregation
