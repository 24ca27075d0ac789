"""The one run function every launcher calls, and what a worker process keeps between runs.

:func:`execute_run` takes a :class:`RunSpec` (a planned run: its arguments, its directory in the sweep's
out directory, the identity the planner computed) and returns a :class:`RunResult`. It claims the run
directory's lock and gives up at once if another live process holds it (``"busy"``: the launcher tries
again later), or waits for it (``wait=True``). Under the lock, a run that another process finished with
the planned identity is left alone (``"by_others"``); otherwise it runs with ``fewclip.runs.run.run_train``
(``"ran"``, or ``"rerun"`` when it replaced results of another identity) and its log goes to ``run.log``
in its directory. A run that fails is ``"failed"`` with the one-line message of ``fewclip.utils.errors`` and its
log (the trace is in the log); it is not recorded as finished, so the next sweep runs it again.

A worker checks that the run it made has the identity the planner computed: a worker whose data, backbone
weights or fewclip differ from the launching machine's would otherwise record numbers that the sweep
does not expect (the run is cleared and reported failed, naming the cause).
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fewclip.features.encode import FeatureCache
from fewclip.features.store import FeatureStore
from fewclip.runs.records import RECORD_KEY, claim_run, clear_run, read_metrics, run_state
from fewclip.runs.run import RunResources, load_train_config, run_train
from fewclip.utils.errors import RunError, describe
from fewclip.utils.explog import LogConfig, for_sweep_cell
from fewclip.utils.progress import quiet_bars
from fewclip.utils.threads import apply as apply_threads

log = logging.getLogger(__name__)

RUN_LOG = "run.log"
STATUSES = ("ran", "rerun", "by_others", "failed", "busy")


@dataclass(frozen=True)
class RunSpec:
    """One planned run, as a launcher hands it to a worker (picklable, no tensors)."""

    out: str  # the sweep's out directory (absolute)
    dir: str  # the run directory, relative to out
    args: tuple[str, ...]  # the run's key=value arguments (fewclip.runs.run.load_train_config)
    identity: Any  # fewclip.runs.records.Identity computed by the planner
    method: str
    backbone: str = ""
    dataset: str = ""
    shots: int = 0
    seed: int = 1
    log_level: str = "info"
    lock_timeout_s: Optional[float] = None
    store: Optional[str] = None  # the feature store's root (None: no store)
    trains_image_tower: bool = False
    log: Optional[LogConfig] = None  # the sweep's log section (fewclip.utils.explog); none: the run's own

    @property
    def path(self) -> Path:
        return Path(self.out) / self.dir

    @property
    def label(self) -> str:
        where = f"{self.dataset} {self.shots}-shot seed {self.seed}" if self.shots else self.dataset
        return f"{self.method} {where} ({self.backbone})"


@dataclass
class RunResult:
    """What became of one run (``status`` in ``STATUSES``)."""

    spec: RunSpec
    status: str
    top1: Optional[float] = None
    wall_time_s: Optional[float] = None
    error: str = ""
    log: str = ""
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")


class WorkerContext:
    """What a worker process keeps between runs: the backbones, datasets and protocol plans it built
    (``fewclip.runs.run.RunResources``, keyed by their config) and its feature cache, backed by the feature store."""

    _per_process: dict[Optional[str], WorkerContext] = {}

    def __init__(self, store: Optional[str] = None):

        self.store_root = store
        self.cache = FeatureCache(FeatureStore(store) if store else None)
        self.resources = RunResources()  # resources(cfg) -> (backbone, protocol plan), each built once

    @classmethod
    def for_process(cls, store: Optional[str]) -> WorkerContext:
        """This process's context for a feature store (kept for the process's next runs)."""
        if store not in cls._per_process:
            cls._per_process[store] = cls(store)
        return cls._per_process[store]


class _ToRoot(logging.Handler):
    """Pass records on to the root logger's handlers (the terminal), at this handler's level."""

    def emit(self, record: logging.LogRecord) -> None:
        for h in logging.getLogger().handlers:
            if record.levelno >= h.level:
                h.handle(record)


class RunLogFile(logging.FileHandler):
    """A run's log file that never stops the run nor prints logging's own traces: the first write, flush, open
    or close that fails (a full disk, a quota, a file size limit) is said once, as one warning naming the file
    and the cause; the rest of that log is dropped, and closing the handler never raises."""

    def __init__(self, path: Path):
        self.failed: Optional[BaseException] = None
        super().__init__(path, mode="w", encoding="utf-8")
        if self.failed is not None:  # not opened: logging.StreamHandler took sys.stderr instead, which is not ours
            self.stream = None

    def _fail(self, e: Optional[BaseException]) -> None:
        if self.failed is not None:
            return
        self.failed = e or RuntimeError("unknown error")
        code = getattr(e, "errno", None)
        why = ("disk full (or quota exceeded)" if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
               else os.strerror(code) if code else f"{type(e).__name__}: {e}")
        stream, self.stream = getattr(self, "stream", None), None  # (none yet when the open failed)
        if stream is not None:
            try:
                stream.close()  # the buffered text cannot reach the file either; its descriptor is released
            except Exception:  # the same write error again (OSError), or anything a stream raises: said already
                pass
        message = f"log file {self.baseFilename} could not be written: {why}; the run goes on without its log"
        record = logging.LogRecord(log.name, logging.WARNING, __file__, 0, message, None, None)
        for h in logging.getLogger().handlers:  # the terminal (the fewclip logger does not propagate meanwhile)
            if record.levelno >= h.level:
                h.handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)  # logging.StreamHandler.emit hands any exception to handleError below

    def handleError(self, record: logging.LogRecord) -> None:
        self._fail(sys.exc_info()[1])

    def _open(self):
        try:
            return super()._open()
        except OSError as e:  # a read-only or full folder: the run itself says what it cannot write
            self._fail(e)
            return None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        try:
            super().close()
        except OSError as e:  # the last buffered lines could not be written: never a dead worker for a log
            self._fail(e)


@contextmanager
def run_log(path: Path, level: str = "info", echo: str = "warning") -> Iterator[None]:
    """Send the ``fewclip`` loggers' records to ``path`` (overwritten) while a run executes; only records of
    level ``echo`` and above also reach the terminal (the launcher prints one line per run). A log that cannot
    be written (a full disk) is said once and the run goes on (``RunLogFile``)."""
    logger = logging.getLogger("fewclip")
    handler = RunLogFile(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    handler.setLevel(getattr(logging, level.upper()))
    forward = _ToRoot(getattr(logging, echo.upper()))
    old = (logger.level, logger.propagate)
    logger.setLevel(getattr(logging, level.upper()))
    logger.addHandler(handler)
    logger.addHandler(forward)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(forward)
        logger.setLevel(old[0])
        logger.propagate = old[1]
        handler.close()


def execute_run(spec: RunSpec, context: Optional[WorkerContext] = None, *, wait: bool = False,
                poll_s: float = 1.0) -> RunResult:
    """Run ``spec`` once (module docstring). ``context``: the process's loaded backbones, datasets and feature
    cache (default: this process's for the spec's store). ``wait``: wait for a run held by another live
    process instead of returning ``"busy"``."""

    context = context or WorkerContext.for_process(spec.store)
    d = spec.path
    lock = claim_run(d, stale_after_s=spec.lock_timeout_s)
    while lock is None and wait:
        time.sleep(poll_s)
        lock = claim_run(d, stale_after_s=spec.lock_timeout_s)
    if lock is None:
        return RunResult(spec, "busy")
    try:
        state = run_state(d, spec.identity)  # under the lock
        if state.finished:
            m = state.metrics or {}
            return RunResult(spec, "by_others", top1=m.get("top1"), wall_time_s=m.get("wall_time_s"))
        with run_log(d / RUN_LOG, spec.log_level):
            try:
                metrics = _run(spec, context, lock)
                record = (read_metrics(d) or {}).get(RECORD_KEY) or {}
                if record.get("identity") != spec.identity.digest:
                    clear_run(d)
                    raise RunError(f"{d}: the run made on {socket.gethostname()} has another identity than the sweep "
                                   f"planned (its data, backbone weights or fewclip version differ from the "
                                   f"launching machine's); make them the same on every worker")
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a failed run does not stop the sweep: reported, rerun by the next sweep
                message, _ = describe(e)
                log.error("run failed: %s", message, exc_info=True)
                return RunResult(spec, "failed", error=message, log=str(d / RUN_LOG))
        return RunResult(spec, "rerun" if state.holds_results else "ran", top1=metrics.get("top1"),
                         wall_time_s=metrics.get("wall_time_s"))
    finally:
        lock.release()


def _run(spec: RunSpec, context: WorkerContext, lock) -> dict[str, Any]:

    cfg = load_train_config(list(spec.args))
    cfg.out = str(spec.path)
    cfg.log_level = spec.log_level
    cfg.log = for_sweep_cell(spec.log, cfg.log, spec.out, spec.dir)  # a logged run per cell, grouped by sweep
    backbone, plan = context.resources(cfg)
    log.info("run %s on %s (pid %d)", spec.dir, socket.gethostname(), os.getpid())
    return run_train(cfg, spec.path, backbone=backbone, plan=plan, cache=context.cache, method=spec.method,
                     lock=lock, overwrite=True, report_prompts=False)  # the sweep reported them, once


def worker_setup(threads: Optional[int] = None, log_level: str = "info", why: str = "the launcher") -> None:
    """Settle a worker process: no progress bars of its own (the launching terminal shows the sweep's),
    ``threads`` intra-op threads (``why``: who chose them, for metrics.json), warnings to its stderr."""
    quiet_bars()
    if threads:
        apply_threads(threads, why)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                            level=logging.WARNING)
    logging.getLogger("fewclip").setLevel(getattr(logging, log_level.upper()))


def run_many(specs: list[RunSpec], threads: Optional[int] = None) -> list[RunResult]:
    """Run several specs one after another in this process, waiting for runs held by others (a SLURM array
    task's work)."""
    if not specs:
        return []
    worker_setup(threads, specs[0].log_level)
    return [execute_run(s, wait=True, poll_s=5.0) for s in specs]
