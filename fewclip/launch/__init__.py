"""Where a sweep's runs execute: this process, worker processes, a Ray cluster or SLURM job arrays.

``fewclip.runs.run_sweep`` plans a sweep (every run's config and identity, which are finished already) and
hands the rest to a launcher here. Every launcher calls the same run function,
:func:`fewclip.launch.worker.execute_run`: claim the run directory's lock (``fewclip.records``), skip a
run that another process finished meanwhile, run it with ``fewclip.runs.run_train`` into the sweep's out
directory, write its log to ``run.log`` beside it, and report a :class:`~fewclip.launch.worker.RunResult`.
So launchers share nothing but the out directory and the feature store (``fewclip.store``), and any mix
of launchers and reruns on one out directory does each run once. On several machines the out directory
and the feature store must be on a filesystem every worker sees (NFS, Lustre, GPFS...), with the same
fewclip installed on each.

``launcher.name``:

* ``local``: ``launcher.workers`` processes on this machine (1: the runs execute in this process). With
  GPUs, worker i uses GPU i modulo their number; without, the CPU threads are split between workers.
* ``ray``: each run a Ray task (``pip install "fewclip[ray]"``), on a running cluster
  (``launcher.address=auto`` or an address) or on a local one started for the sweep; ``launcher.gpus_per_run``
  may be a fraction for methods on cached features, and is rounded up to whole GPUs for a method that
  trains the image tower (``Adapter.will_train_image_tower``).
* ``slurm``: SLURM job arrays through submitit (``pip install "fewclip[slurm]"``), ``launcher.runs_per_task``
  runs per array task; ``launcher.dry_run=true`` prints the sbatch script instead of submitting it.

The launching terminal shows one line per finished run and an overall bar; a failed run does not stop
the sweep: it is listed at the end with its log, and the next ``fewclip sweep`` runs it again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray", "slurm")
EXTRAS = {"ray": ("ray", "ray"), "slurm": ("submitit", "slurm")}  # launcher -> (module, extra)


class LauncherError(ValueError):
    """A launcher that cannot start (a missing optional dependency, no SLURM here); the message says what to do."""


@dataclass
class LauncherConfig:
    """The ``launcher`` section of a sweep config (``launcher=ray`` sets its name)."""

    # "local", "ray" or "slurm".
    name: str = "local"
    # local: worker processes (1: the runs execute in the launching process, one after another).
    workers: int = 1
    # ray: "auto" (the running cluster), a cluster address (ray://host:10001 or host:6379), or null: start a
    # local cluster for this sweep, with `cpus` CPUs (null: all).
    address: Optional[str] = None
    cpus: Optional[int] = None
    # ray: resources of one run. gpus_per_run may be a fraction (0.25: four runs on cached features share a
    # GPU); a method that trains the image tower gets it rounded up to whole GPUs.
    cpus_per_run: float = 1.0
    gpus_per_run: float = 0.0
    # ray: times a run is retried when its worker dies (0: it is listed as failed, and the next sweep reruns it).
    max_retries: int = 0
    # slurm: sbatch settings of each array task.
    partition: Optional[str] = None
    gpus_per_task: int = 1
    cpus_per_task: int = 4
    mem_gb: int = 32
    time_min: int = 60
    # slurm: array tasks running at once (sbatch --array=0-N%P), and runs executed one after another per task
    # (more than 1 loads the backbone once for several runs; time_min must cover them all).
    array_parallelism: int = 32
    runs_per_task: int = 1
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    job_name: str = "fewclip"
    # slurm: shell lines run before the task (module load ..., source venv/bin/activate), and any other sbatch
    # option as name: value (e.g. {exclude: node12}).
    setup: List[str] = field(default_factory=list)
    sbatch: Dict[str, str] = field(default_factory=dict)
    # slurm: submitit's folder (job scripts, pickles, task logs); null: OUT/.submitit.
    folder: Optional[str] = None
    # slurm: "slurm" submits with sbatch; "local" runs the same array tasks as processes on this machine.
    cluster: str = "slurm"
    # slurm: print the sbatch script and the runs of each array task; submit nothing.
    dry_run: bool = False

    def __post_init__(self) -> None:
        if self.name not in LAUNCHERS:
            raise ValueError(f"launcher.name must be one of {', '.join(LAUNCHERS)}, got {self.name!r}")
        if self.workers < 1:
            raise ValueError(f"launcher.workers must be >= 1, got {self.workers}")
        if self.cpus is not None and self.cpus < 1:
            raise ValueError(f"launcher.cpus must be >= 1 or null (all), got {self.cpus}")
        if not self.cpus_per_run > 0 or not math.isfinite(self.cpus_per_run):
            raise ValueError(f"launcher.cpus_per_run must be > 0, got {self.cpus_per_run}")
        if not self.gpus_per_run >= 0 or not math.isfinite(self.gpus_per_run):
            raise ValueError(f"launcher.gpus_per_run must be >= 0 (a fraction shares a GPU), got {self.gpus_per_run}")
        if self.gpus_per_run > 1 and self.gpus_per_run != int(self.gpus_per_run):
            raise ValueError(f"launcher.gpus_per_run above 1 must be a whole number, got {self.gpus_per_run}")
        if self.max_retries < 0:
            raise ValueError(f"launcher.max_retries must be >= 0, got {self.max_retries}")
        for key in ("gpus_per_task",):
            if getattr(self, key) < 0:
                raise ValueError(f"launcher.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("cpus_per_task", "mem_gb", "time_min", "array_parallelism", "runs_per_task"):
            if getattr(self, key) < 1:
                raise ValueError(f"launcher.{key} must be >= 1, got {getattr(self, key)}")
        if self.cluster not in ("slurm", "local"):
            raise ValueError(f"launcher.cluster must be 'slurm' or 'local', got {self.cluster!r}")
        if self.dry_run and self.name != "slurm":
            raise ValueError("launcher.dry_run prints a SLURM submission: use it with launcher=slurm")


def require_extra(launcher: str):
    """The optional module a launcher needs, or a LauncherError naming the install command."""
    import importlib

    module, extra = EXTRAS[launcher]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise LauncherError(f"launcher={launcher} needs {module}, which is not installed: "
                            f"pip install \"fewclip[{extra}]\"") from None


def check_launcher(cfg: LauncherConfig) -> None:
    """Fail early (a LauncherError) when the launcher's optional dependency is missing."""
    if cfg.name in EXTRAS:
        require_extra(cfg.name)


def gpus_for(cfg: LauncherConfig, trains_image_tower: bool) -> float:
    """The GPUs one run asks for: ``gpus_per_run``, rounded up to whole GPUs for a run that trains the image
    tower (its activations and optimiser state do not share a GPU well)."""
    if cfg.gpus_per_run > 0 and trains_image_tower:
        return float(max(1, math.ceil(cfg.gpus_per_run)))
    return float(cfg.gpus_per_run)


def launch(cfg: LauncherConfig, specs: Sequence, *, out: Path, context=None, poll_s: float = 1.0):
    """Execute ``specs`` (``worker.RunSpec``) with the launcher ``cfg`` names; returns ``progress.Outcome``.
    ``context``: the launching process's ``worker.WorkerContext`` (backbones and datasets it already loaded),
    used by the in-process launcher."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .progress import SweepProgress

    if cfg.name == "slurm" and cfg.dry_run:
        from .slurm import dry_run

        return dry_run(cfg, list(specs), out=out)
    check_launcher(cfg)
    progress = SweepProgress(len(specs), launcher=describe(cfg))
    with logging_redirect_tqdm():  # log lines above the bar, not through it
        try:
            if cfg.name == "local":
                from .local import run_local

                run_local(cfg, list(specs), progress, context=context, poll_s=poll_s)
            elif cfg.name == "ray":
                from .ray_tasks import run_ray

                run_ray(cfg, list(specs), progress, poll_s=poll_s)
            else:
                from .slurm import run_slurm

                run_slurm(cfg, list(specs), progress, out=out, poll_s=max(poll_s, 2.0))
        finally:
            progress.close()
    return progress.outcome()


def describe(cfg: LauncherConfig) -> str:
    if cfg.name == "local":
        return "this process" if cfg.workers == 1 else f"{cfg.workers} local worker processes"
    if cfg.name == "ray":
        return f"Ray ({cfg.address or 'a local cluster'})"
    return f"SLURM ({cfg.cluster})"
