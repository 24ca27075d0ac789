"""fewclip from Python: the same runs, sweeps and reports as the command line, as functions.

::

    import fewclip

    run = fewclip.train("coop", backbone="toy-clip", data="toy-shapes", shots=4, seed=1, out="runs/coop",
                        options={"n_ctx": 4}, train={"epochs": 5})
    run.top1                      # test accuracy (%), as metrics.json records it
    run.predict(images, top_k=3)  # the trained classifier (exported once, then loaded)

    zs = fewclip.zeroshot(backbone="toy-clip", data="toy-shapes", out="runs/zs")
    result = fewclip.sweep("sweep/quick.yaml", out="runs/quick")   # resumable, like `fewclip sweep`
    result.report.markdown
    fewclip.load_run("runs/coop").metrics
    fewclip.list_adapters()

Every keyword is a key of the command's config: a plain value sets it (``shots=4``, ``backbone="toy-clip"``), a
mapping sets keys of its section (``data={"name": "toy-shapes", "max_test": 100}`` is ``data.name=toy-shapes
data.max_test=100``), and ``args`` takes YAML pieces and ``key=value`` strings exactly as the command line does
(they come first; keywords win). The command line is a thin layer over these functions (``fewclip.cli.commands``),
so a run made here is the run ``fewclip train`` would make with the same keys: same identity, same folder, same
numbers. A method's own options go in ``options`` (``options={"n_ctx": 4}`` is ``adapter.n_ctx=4``).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import OmegaConf

from fewclip.adapter.base import ADAPTERS, adapter_info
from fewclip.adapter.exports import load_prompts
from fewclip.backbones.backbone import list_backbones as _list_backbones
from fewclip.config.compose import RunConfig, load_config
from fewclip.config.report import ReportOptions
from fewclip.data.base import DATASETS, dataset_name
from fewclip.data.splits import read_split
from fewclip.features.encode import FeatureCache
from fewclip.features.store import open_store
from fewclip.report import NoRunsFoundError, write_report
from fewclip.runs.export import export_run
from fewclip.runs.records import RunDirError, prepare_dir, run_state
from fewclip.runs.run import as_train_config, load_train_config, run_train
from fewclip.runs.sweep import load_sweep_config, run_sweep, sweep_lock
from fewclip.utils.io import read_json

PathLike = Union[str, Path]
_PLAIN = re.compile(r"^[\w./:+-]+$")  # written as is in a key=value argument; anything else as a YAML string


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v if _PLAIN.match(v) else json.dumps(v)
    if isinstance(v, Path):
        return _value(str(v))
    return json.dumps(v)  # numbers, booleans, None (null), lists: JSON is YAML's flow style


def to_args(keys: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``{"shots": 4, "data": {"name": "toy-shapes"}}`` -> ``["shots=4", "data.name=toy-shapes"]``: keyword
    arguments as the command line's ``key=value`` strings (None values are left out: the config's default)."""
    out: list[str] = []
    for key, value in keys.items():
        if value is None:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += to_args(value, prefix=f"{name}.")
        else:
            out.append(f"{name}={_value(value)}")
    return out


# ---------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------


@dataclass
class Run:
    """A finished run's folder: its metrics, config and split, and its trained classifier."""

    dir: Path
    metrics: dict[str, Any]
    _classifier: Any = field(default=None, repr=False, compare=False)

    @property
    def top1(self) -> Optional[float]:
        """Test top-1 accuracy in percent (the training classes' test set under a generalisation protocol)."""
        return self.metrics.get("top1")

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved config (``config.yaml``) as a plain dict."""
        return OmegaConf.to_container(OmegaConf.load(self.dir / "config.yaml"), resolve=True)

    @property
    def split(self):
        """The few-shot split the run trained on (``split.json``: class names and image ids per split)."""
        return read_split(self.dir / "split.json")

    def classifier(self, device: str = "auto", **export_options):
        """The trained classifier: the run exported in its method's format (once, into the run folder) and
        loaded back, as ``fewclip.load_prompts`` does. Methods without an export format raise ``ExportError``."""
        if self._classifier is None:
            exported = export_run(self.dir, **export_options)
            self._classifier = load_prompts(exported.path, device=device)
        return self._classifier

    def predict(self, images, top_k: int = 1):
        """``[(class name, probability), ...]`` per image (paths, PIL images or a tensor batch)."""
        return self.classifier().predict(images, top_k=top_k)


def load_run(run_dir: PathLike) -> Run:
    """A finished run folder (what ``fewclip train`` or a sweep wrote); refuses an unfinished or changed one."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.json").is_file():
        raise RunDirError(f"{run_dir} holds no finished run (no metrics.json); pass a folder `fewclip train` or "
                          f"`fewclip sweep` wrote")
    state = run_state(run_dir)
    if not state.finished and state.kind != "legacy":
        raise RunDirError(f"{run_dir} is not a valid finished run: {state.reason}; run it again")
    return Run(run_dir, read_json(run_dir / "metrics.json"))


def _store_cache() -> FeatureCache:
    return FeatureCache(open_store())


def default_train_dir(cfg) -> str:
    prefix = "" if cfg.protocol == "fewshot" else f"{cfg.protocol}_"
    return (f"runs/train/{prefix}{Path(cfg.backbone.name).stem}_{dataset_name(cfg.data)}"
            f"_{cfg.adapter.name}_{cfg.shots}shot_seed{cfg.seed}")


def default_zeroshot_dir(cfg) -> str:
    prefix = "" if cfg.protocol == "fewshot" else f"{cfg.protocol}_"
    return f"runs/zeroshot/{prefix}{Path(cfg.backbone.name).stem}_{dataset_name(cfg.data)}"


def train_config(adapter: Optional[str] = None, *, options: Optional[Mapping[str, Any]] = None,
                 args: Sequence[str] = (), **keys):
    """The composed, checked config of a ``train`` run (``fewclip.config.compose``), without running it."""
    section = {"name": adapter, **(options or {})}
    return load_train_config([*args, *to_args({"adapter": section, **keys})])


def run_config(cfg, out: Optional[PathLike] = None, default: Optional[str] = None) -> Run:
    """Run a composed train config into ``out`` (else ``cfg.out``, else the command's default folder)."""
    path = Path(out or cfg.out or default or default_train_dir(cfg))
    fresh = not path.exists()
    folder = prepare_dir(path, "out")
    try:
        run_train(cfg, folder, cache=_store_cache())
    except BaseException:  # a folder this call made and nothing was written to is removed (a failed run stays)
        if fresh and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise
    return Run(folder, read_json(folder / "metrics.json"))  # as recorded: with its run record


def train(adapter: Optional[str] = None, *, options: Optional[Mapping[str, Any]] = None, args: Sequence[str] = (),
          **keys) -> Run:
    """Train one method on one few-shot split and score it: ``fewclip train`` (see the module docstring)."""
    return run_config(train_config(adapter, options=options, args=args, **keys))


def zeroshot(*, args: Sequence[str] = (), **keys) -> Run:
    """Score the zero-shot classifier: ``fewclip zeroshot``."""
    cfg: RunConfig = load_config([*args, *to_args(keys)], RunConfig)
    train_cfg = as_train_config(cfg, adapter_info("zeroshot").config_cls())
    return run_config(train_cfg, default=default_zeroshot_dir(cfg))


# ---------------------------------------------------------------------------
# sweeps and reports
# ---------------------------------------------------------------------------


@dataclass
class SweepResult:
    """What a sweep did (``counts``: planned, done_before, ran, failed ...; ``failures``: each failed run with
    its one-line error and log) and its report (None when ``report`` was off or no run finished)."""

    out: Path
    counts: dict[str, Any]
    report: Any = None

    @property
    def failures(self) -> list:
        return list(self.counts.get("failures") or [])


def sweep(spec: Optional[PathLike] = None, *, args: Sequence[str] = (), **keys) -> SweepResult:
    """Run a sweep (``fewclip sweep``): ``spec`` is a sweep YAML (``sweep/quick.yaml`` names a packaged one);
    finished runs are skipped, so calling it again resumes. Writes and returns the report unless ``report=False``."""
    cfg = load_sweep_config([*([str(spec)] if spec is not None else []), *args, *to_args(keys)])
    out = prepare_dir(Path(cfg.out or "runs/sweep"), "out")
    counts = run_sweep(cfg, out)
    result = SweepResult(out, counts)
    if cfg.report and not counts.get("dry_run"):
        try:
            with sweep_lock(out, cfg.lock_timeout_s):
                result.report = write_report(out)
        except NoRunsFoundError:
            if not result.failures:
                raise
    return result


def report(run_root: Union[PathLike, Sequence[PathLike]], out_dir: Optional[PathLike] = None,
           options: Optional[ReportOptions] = None, **keys):
    """Tables, figures, CSV/JSON/LaTeX/HTML of the runs under ``run_root`` (``fewclip report``); keywords are
    ``ReportOptions`` fields (``methods=[...]``, ``formats=[...]``)."""
    if options is None:
        options = ReportOptions(**keys)
    return write_report(run_root, out_dir, options)


# ---------------------------------------------------------------------------
# what can be used
# ---------------------------------------------------------------------------


def list_adapters() -> list[str]:
    """The registered methods (fewclip's and installed plugins'), by name."""
    return ADAPTERS.names()


def list_datasets() -> list[str]:
    """The registered datasets (fewclip's and installed plugins'), by name."""
    return DATASETS.names()


def list_backbones() -> list[dict[str, str]]:
    """The backbones fewclip can load: shipped reference cards and open_clip architectures, with geometry."""
    return _list_backbones()
