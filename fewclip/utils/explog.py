"""Experiment logging: a run's curves and results where researchers already look (TensorBoard, Weights & Biases).

``log=tensorboard``, ``log=wandb`` or ``log=[tensorboard,wandb]`` (the ``log`` section, :class:`LogConfig`;
default: none). A run that trains logs

* every ``log.every_n_steps`` optimiser steps: ``train/loss`` (and the adapter's other loss terms,
  ``train/<term>``) and ``train/lr`` (the first parameter group's learning rate);
* after every epoch: ``epoch/loss`` (the epoch's mean, as ``metrics.json``'s ``loss_curve``), its other terms,
  and ``val/top1`` where the loop scores a validation set (``train.select=val``);
* at the end: ``final/<key>`` for every number of ``metrics.json`` (accuracy, ``train_time_s``,
  ``wall_time_s``, ``images_encoded``, peak memory ...; ``final/evals/<test set>/top1`` under a
  generalisation protocol): scalars at the last step in TensorBoard, the run's summary in W&B.

Where: TensorBoard's event files go to ``DIR/tensorboard/NAME/`` and W&B's run folders to ``DIR/wandb/``, where
``DIR`` is ``log.dir`` (default: the run's out folder; in a sweep the sweep's out folder) and ``NAME`` is
``log.name`` (default: the out folder's name; in a sweep the cell's path, ``toy-clip/toy-shapes/coop/1shot/
seed1``, after ``log.name`` if set). In a sweep every cell is one run, and W&B groups them by ``log.group``
(default: the sweep's name, its out folder's name). A run that runs again replaces its event files.
Logging settings are no part of a run's identity (``fewclip.runs.records``).

W&B's mode (``log.wandb.mode``): ``offline`` writes the run to ``DIR/wandb/offline-run-*`` and opens no
connection (``wandb sync DIR/wandb`` uploads it later), ``online`` streams to the server, ``disabled`` logs
nothing. null (the default): the environment's ``WANDB_MODE`` if set, else ``online`` where W&B has
credentials (``WANDB_API_KEY``, or the ~/.netrc entry of ``wandb login``) and ``offline`` otherwise, so that a
machine without credentials never waits on a network.

Logging never stops a run: a backend that fails to open or to write gives one warning line and is dropped,
and the run goes on. A backend whose library is missing is refused before the run starts, with the pip
command (:func:`check`).

The run opens its logger (:func:`logging_run`, in ``fewclip.runs.run``) and the training loop reports to whichever
is open (:func:`current`), so a fit-style adapter whose ``fit`` runs ``fewclip.training.engine.train_loop`` is logged
too, without a logger in every signature. This module imports neither torch nor the logging libraries until
a backend is opened: the config dataclasses here are read by ``fewclip --help``.
"""
from __future__ import annotations

import contextvars
import dataclasses
import importlib
import logging
import math
import netrc
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from fewclip.utils.errors import InputError

log = logging.getLogger(__name__)

# backend -> (the module it needs, the fewclip extra that installs it)
BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
WANDB_MODES = ("online", "offline", "disabled")
# metrics.json entries that are not one number per run (or not results): never logged as final scalars
NOT_FINAL = ("run_record", "per_class", "n_test_per_class", "shots_per_class", "backbone_info", "loss_curve",
             "loss_terms", "templates", "identical_prompts")


class ExpLogError(InputError):
    """A logging backend that cannot be used (its library is not installed); the message says what to do."""


@dataclass
class WandbConfig:
    """The ``log.wandb`` section."""

    mode: Optional[str] = field(default=None, metadata={"help": (
        "online, offline (written under DIR/wandb, no connection; `wandb sync` uploads it) or disabled; null: "
        "$WANDB_MODE if set, else online with W&B credentials (WANDB_API_KEY or `wandb login`), else offline.")})
    project: str = field(default="fewclip", metadata={"help": "The W&B project."})
    entity: Optional[str] = field(default=None, metadata={"help": "The W&B entity (user or team); null: W&B's default."})
    tags: list[str] = field(default_factory=list, metadata={"help": "Tags of the W&B run."})
    init_timeout_s: float = field(default=30.0, metadata={"help": (
        "Online mode: seconds to wait for the server when the run starts; past it the run goes on unlogged.")})

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"log.wandb.mode must be one of {', '.join(WANDB_MODES)} or null, got {self.mode!r}")
        if not self.init_timeout_s > 0:
            raise ValueError(f"log.wandb.init_timeout_s must be > 0, got {self.init_timeout_s}")
        self.tags = list(self.tags)


@dataclass
class LogConfig:
    """The ``log`` section: where a run's curves and results are logged (``log=tensorboard`` is short for
    ``log.backends=[tensorboard]``)."""

    backends: list[str] = field(default_factory=list, metadata={"help": (
        "tensorboard, wandb, both ([tensorboard,wandb]) or none ([]): `log=tensorboard` is short for "
        "log.backends=[tensorboard]. Each needs its extra: pip install \"fewclip[tensorboard]\" / \"fewclip[wandb]\".")})
    dir: Optional[str] = field(default=None, metadata={"help": (
        "Where the logs go: TensorBoard's event files under DIR/tensorboard/NAME, W&B's run folders under "
        "DIR/wandb. null: the run's out folder (a sweep's: the sweep's out folder).")})
    name: Optional[str] = field(default=None, metadata={"help": (
        "The run's name (its TensorBoard sub-folder, its W&B name); null: the out folder's name. In a sweep: the "
        "cell's path (toy-clip/toy-shapes/coop/1shot/seed1), after this name if set.")})
    group: Optional[str] = field(default=None, metadata={"help": (
        "The W&B group; null: none (in a sweep: the sweep's name, its out folder's name).")})
    every_n_steps: int = field(default=10, metadata={"help": (
        "Log the step's loss and learning rate every this many optimiser steps (the epoch's mean loss and the "
        "validation accuracy are logged after every epoch).")})
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": (
        "Weights & Biases settings (log=wandb): project, entity, mode.")})

    def __post_init__(self) -> None:
        names = [b for b in self.backends if b != "none"]
        unknown = [b for b in names if b not in BACKENDS]
        if unknown:
            raise ValueError(f"log must name {', '.join(BACKENDS)} or none, got {unknown[0]!r} "
                             f"(e.g. log=tensorboard or log=[tensorboard,wandb])")
        self.backends = list(dict.fromkeys(names))
        if self.every_n_steps < 1:
            raise ValueError(f"log.every_n_steps must be >= 1, got {self.every_n_steps}")


_BROKEN: dict[str, str] = {}  # backend -> why its installed library failed to import (said once per process)


def check(cfg: LogConfig) -> None:
    """Fail before any work (an ExpLogError, exit 2) when a backend's library is not installed. One that is
    installed but fails to import is one warning, and the runs go on without that backend (``open_backends``
    leaves it out): logging never stops a run."""
    for name in cfg.backends:
        module, extra = BACKENDS[name]
        try:
            importlib.import_module(module)
            _BROKEN.pop(name, None)
            continue
        except ModuleNotFoundError as e:  # absent (a bad input), or a dependency of it absent (broken: below)
            if e.name == module:  # the library itself is absent: the user asked for it, so say how to get it
                raise ExpLogError(f"log={name} needs {module}, which is not installed: pip install "
                                  f"\"fewclip[{extra}]\"") from None
            why = _one_line(e)
        # An installed library whose import fails (a dependency of the wrong version, a damaged install, a
        # sys.exit in its import) can raise anything: it is that library's failure, never a reason to stop a run.
        except (Exception, SystemExit) as e:  # see above: an installed library failing on import
            why = _one_line(e)
        if _BROKEN.get(name) != why:
            log.warning("log=%s: importing %s failed (%s); the runs go on without it (reinstall it: pip install "
                        "--force-reinstall \"fewclip[%s]\")", name, module, why, extra)
        _BROKEN[name] = why


def for_sweep_cell(sweep: Optional[LogConfig], own: LogConfig, sweep_out: str | os.PathLike, cell: str) -> LogConfig:
    """A sweep cell's log settings: the sweep's ``log`` section if it names a backend, else the run's own (from
    ``sweep.args``), with the sweep's defaults: the sweep's out folder as ``dir``, the cell's path as the name
    (after ``log.name`` if set, so that cells never share a folder), the sweep's name as the W&B group. Without
    a backend the run's own section, unchanged."""
    cfg = sweep if sweep is not None and sweep.backends else own
    if not cfg.backends:
        return own
    cell = Path(cell).as_posix()
    return dataclasses.replace(cfg, dir=cfg.dir or str(sweep_out), name=f"{cfg.name}/{cell}" if cfg.name else cell,
                               group=cfg.group or Path(sweep_out).resolve().name)


def wandb_logged_in(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether W&B has credentials here: $WANDB_API_KEY, or the entry `wandb login` writes to ~/.netrc (or
    $NETRC) for the server ($WANDB_BASE_URL, default api.wandb.ai)."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc(environ.get("NETRC") or os.path.expanduser("~/.netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: WandbConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The W&B mode a run uses (module docstring): ``log.wandb.mode``, else $WANDB_MODE, else online with
    credentials (``wandb_logged_in``) and offline without."""
    if cfg.mode is not None:
        return cfg.mode
    env = environ.get("WANDB_MODE", "").strip().lower()
    if env == "dryrun":  # W&B's old name for offline
        return "offline"
    if env in WANDB_MODES:
        return env
    return "online" if wandb_logged_in(environ) else "offline"


def final_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a run's ``metrics.json`` as ``final/<key>`` (``final/evals/<test set>/<key>`` for a
    protocol's test sets); not the per-class tables, curves, record or backbone description."""
    out: dict[str, float] = {}

    def add(prefix: str, d: Mapping[str, Any]) -> None:
        for k, v in d.items():
            if k in NOT_FINAL:
                continue
            if isinstance(v, Mapping):
                if k == "evals" or prefix.startswith("final/evals"):
                    add(f"{prefix}{k}/", v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{prefix}{k}"] = float(v)

    add("final/", metrics)
    return out


# ---------------------------------------------------------------------------
# the logger a run opens and the loop reports to
# ---------------------------------------------------------------------------


class Backend:
    """One place a run logs to. ``scalars`` at a step, ``summary`` at the end, ``close`` (``failed``: the run
    did not finish)."""

    name = ""

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def summary(self, values: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


class TensorBoardBackend(Backend):
    """Event files in ``folder`` (written by torch's SummaryWriter; event files of an earlier attempt at the
    same run are removed first, so the folder shows the run that is there)."""

    name = "tensorboard"

    def __init__(self, folder: Path, config_yaml: str = ""):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: needs the tensorboard package

        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))
        if config_yaml:
            self.writer.add_text("config", "```\n" + config_yaml + "\n```", 0)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def summary(self, values: Mapping[str, float], step: int) -> None:
        self.scalars(values, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbBackend(Backend):
    """A W&B run under ``folder``/wandb; in offline mode no connection is ever opened."""

    name = "wandb"

    def __init__(self, cfg: LogConfig, folder: Path, name: str, config: Mapping[str, Any]):
        import wandb  # optional extra: fewclip[wandb]

        mode = wandb_mode(cfg.wandb)
        folder.mkdir(parents=True, exist_ok=True)
        # silent, no console capture (fewclip's own log and bars stay as they are), no git or code upload; a
        # bounded wait for the server in online mode
        settings = wandb.Settings(mode=mode, silent=True, console="off", disable_git=True, save_code=False,
                                  init_timeout=float(cfg.wandb.init_timeout_s))
        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.group, name=name,
                              tags=list(cfg.wandb.tags) or None, dir=str(folder), config=dict(config),
                              settings=settings)
        self.mode = mode

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, values: Mapping[str, float], step: int) -> None:
        self.run.summary.update(dict(values))

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class ExpLogger:
    """What the training loop and the run report to: the open backends, each dropped with one warning at its
    first failure. Without backends (``log`` none) every call does nothing."""

    def __init__(self, backends: Sequence[Backend] = (), every_n_steps: int = 10):
        self.backends = list(backends)
        self.every = every_n_steps
        self.last_step = 0

    def _each(self, what: str, call) -> None:
        for b in list(self.backends):
            try:
                call(b)
            except Exception as e:  # logging never stops a run
                self.drop(b, what, e)

    def drop(self, b: Backend, what: str, e: BaseException) -> None:
        log.warning("log=%s: %s failed (%s); the run goes on without it", b.name, what, _one_line(e))
        self.backends.remove(b)
        try:
            b.close(failed=True)
        except Exception:  # already failed once: one warning is enough
            pass

    def step(self, step: int, values: Mapping[str, float], lr: float) -> None:
        """After optimiser step ``step`` (1-based): the step's loss terms and learning rate, every
        ``every_n_steps`` steps (and the first)."""
        if not self.backends:
            return
        self.last_step = step
        if step % self.every and step != 1:
            return
        scalars = {f"train/{k}": float(v) for k, v in values.items()}
        scalars["train/lr"] = float(lr)
        self._each("writing", lambda b: b.scalars(scalars, step))

    def epoch(self, step: int, entry: Mapping[str, Any]) -> None:
        """After an epoch that ended at step ``step``: its mean loss terms and validation accuracy (the loop's
        history entry: ``{"epoch", "loss", ..., "val_top1"}``)."""
        if not self.backends:
            return
        self.last_step = max(self.last_step, step)
        names = {"epoch": "epoch", "val_top1": "val/top1"}
        scalars = {names.get(k, f"epoch/{k}"): float(v) for k, v in entry.items()}
        self._each("writing", lambda b: b.scalars(scalars, step))

    def final(self, metrics: Mapping[str, Any]) -> None:
        """The finished run's numbers (``final_scalars`` of its metrics.json)."""
        if not self.backends:
            return
        values = final_scalars(metrics)
        self._each("writing the final metrics", lambda b: b.summary(values, self.last_step))

    def close(self, failed: bool = False) -> None:
        for b in list(self.backends):
            try:
                b.close(failed)
            except Exception as e:  # wandb's or tensorboard's, any type: logging never stops a run
                log.warning("log=%s: closing failed (%s); the run's results are not affected", b.name, _one_line(e))
        self.backends = []


NULL = ExpLogger()
_CURRENT: contextvars.ContextVar[ExpLogger] = contextvars.ContextVar("fewclip_explog", default=NULL)


def current() -> ExpLogger:
    """The logger of the run in progress (one that does nothing outside a run, or with ``log`` none)."""
    return _CURRENT.get()


def open_backends(cfg: LogConfig, out: Path, config: Mapping[str, Any], config_yaml: str = "") -> ExpLogger:
    """An ExpLogger with every backend of ``cfg`` that opens; one that fails is a warning and left out."""
    base = Path(cfg.dir) if cfg.dir else Path(out)
    name = cfg.name or Path(out).resolve().name
    backends: list[Backend] = []
    for b in cfg.backends:
        if b in _BROKEN:  # its library fails to import: said once by check()
            continue
        try:
            if b == "tensorboard":
                backends.append(TensorBoardBackend(base / "tensorboard" / name, config_yaml))
            else:
                backends.append(WandbBackend(cfg, base, name, config))
        except Exception as e:  # logging never stops a run
            log.warning("log=%s: opening failed (%s); the run goes on without it", b, _one_line(e))
    return ExpLogger(backends, cfg.every_n_steps)


@contextmanager
def logging_run(cfg: LogConfig, out: Path, config: Mapping[str, Any], config_yaml: str = "") -> Iterator[ExpLogger]:
    """The run's logger while the block runs (``current()`` inside it); closed at the end, marked failed when
    the block raises."""
    xlog = open_backends(cfg, out, config, config_yaml) if cfg.backends else ExpLogger()
    token = _CURRENT.set(xlog)
    failed = True
    try:
        yield xlog
        failed = False
    finally:
        _CURRENT.reset(token)
        xlog.close(failed)
