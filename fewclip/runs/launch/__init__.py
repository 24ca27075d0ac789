"""Where a sweep's runs execute: this process, worker processes, a Ray cluster or SLURM job arrays.

``fewclip.runs.sweep.run_sweep`` plans a sweep (every run's config and identity, which are finished already) and
hands the rest to a launcher here. Every launcher calls the same run function,
:func:`fewclip.runs.launch.worker.execute_run`: claim the run directory's lock (``fewclip.runs.records``), skip a
run that another process finished meanwhile, run it with ``fewclip.runs.run.run_train`` into the sweep's out
directory, write its log to ``run.log`` beside it, and report a :class:`~fewclip.runs.launch.worker.RunResult`.
So launchers share nothing but the out directory and the feature store (``fewclip.features.store``), and any mix
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

from collections.abc import Sequence
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from fewclip.runs.launch.base import (
    EXTRAS,
    LAUNCHERS,
    Launcher,
    LauncherConfig,
    LauncherError,
    check_launcher,
    gpus_for,
    register_launcher,
    require_extra,
)
from fewclip.runs.launch.local import LocalConfig
from fewclip.runs.launch.progress import SweepProgress
from fewclip.runs.launch.ray_tasks import RayConfig
from fewclip.runs.launch.slurm import SlurmConfig

__all__ = ["EXTRAS", "LAUNCHERS", "Launcher", "LauncherConfig", "LauncherError", "LocalConfig", "RayConfig",
           "SlurmConfig", "check_launcher", "describe", "gpus_for", "launch", "register_launcher", "require_extra"]


def launch(cfg: LauncherConfig, specs: Sequence, *, out: Path, context=None, poll_s: float = 1.0):
    """Execute ``specs`` (``worker.RunSpec``) with the launcher ``cfg`` names; returns ``progress.Outcome``.
    ``context``: the launching process's ``worker.WorkerContext`` (backbones and datasets it already loaded),
    used by the in-process launcher."""
    launcher = LAUNCHERS.get(cfg.name)
    if launcher.dry_run is not None and getattr(cfg, "dry_run", False):
        return launcher.dry_run(cfg, list(specs), out=out)
    check_launcher(cfg)
    progress = SweepProgress(len(specs), launcher=describe(cfg), specs=specs)
    with logging_redirect_tqdm():  # log lines above the bar, not through it
        try:
            launcher.run(cfg, list(specs), progress, out=out, context=context, poll_s=poll_s)
        finally:
            progress.close()
    return progress.outcome()


def describe(cfg: LauncherConfig) -> str:
    return LAUNCHERS.get(cfg.name).describe(cfg)
