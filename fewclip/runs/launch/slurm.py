"""``launcher=slurm``: SLURM job arrays through submitit (``pip install "fewclip[slurm]"``).

The runs are cut into array tasks of ``launcher.runs_per_task`` runs each, in plan order (so a task's runs
share a backbone and dataset); one ``sbatch`` array job runs them, at most ``launcher.array_parallelism``
tasks at once, each task with ``launcher.gpus_per_task`` GPUs, ``cpus_per_task`` CPUs, ``mem_gb`` GB and
``time_min`` minutes (``--partition``, ``--account``, ``--qos``, ``--constraint`` and any ``launcher.sbatch``
option where given). A task runs its runs one after another with ``execute_run``, waiting for a run
that another launcher holds. The launching process waits for the tasks and prints each task's runs as it
ends; if it is stopped, the tasks go on, and the next ``fewclip sweep`` skips what they finished.

The launching process follows the tasks by their result files and ``squeue`` (a task that left the queue
without a result was cancelled, ran out of time or lost its node: its runs are listed as failed), not only by
submitit's ``sacct`` calls: on a cluster without accounting storage (common on small clusters) sacct fails
and submitit would wait forever for a task that was cancelled. Each distinct warning of submitit's (the
sacct warning of every poll, there) is printed once, through fewclip's log handler only.

``launcher.dry_run=true`` prints the sbatch script submitit would submit, and the runs of each task,
and submits nothing. ``launcher.cluster=local`` runs the same array tasks as processes on this machine
(submitit's local executor: all at once), which is how the tests exercise this code path.
"""
from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from fewclip.config.sections import SlurmConfig
from fewclip.runs.launch.base import Launcher, LauncherError, register_launcher, require_extra
from fewclip.runs.launch.local import cpu_count
from fewclip.runs.launch.progress import Outcome, SweepProgress
from fewclip.runs.launch.worker import RunResult, RunSpec, run_many
from fewclip.runs.records import run_state

log = logging.getLogger(__name__)


def describe_slurm(cfg: SlurmConfig) -> str:
    return f"SLURM ({cfg.cluster})"


def chunks(specs: list[RunSpec], size: int) -> list[list[RunSpec]]:
    return [specs[i:i + size] for i in range(0, len(specs), size)]


def sbatch_parameters(cfg) -> dict[str, Any]:
    """The sbatch settings of each array task, in submitit's SlurmExecutor names."""
    p: dict[str, Any] = {"job_name": cfg.job_name, "time": cfg.time_min, "cpus_per_task": cfg.cpus_per_task,
                         "mem": f"{cfg.mem_gb}GB", "array_parallelism": cfg.array_parallelism}
    if cfg.gpus_per_task:
        p["gpus_per_node"] = cfg.gpus_per_task  # one task per allocation: its GPUs
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cfg, key):
            p[key] = getattr(cfg, key)
    if cfg.setup:
        p["setup"] = list(cfg.setup)
    if cfg.sbatch:
        p["additional_parameters"] = dict(cfg.sbatch)
    return p


def folder_of(cfg, out: Path) -> Path:
    return Path(cfg.folder).expanduser().resolve() if cfg.folder else (Path(out) / ".submitit").resolve()


def submission_text(cfg, out: Path, tasks: int) -> str:
    """The sbatch script of the array job, exactly as submitit's SlurmExecutor writes it."""
    require_extra("slurm")
    # submitit makes the script in a private function of its slurm module (SlurmExecutor, its only public
    # door, refuses to exist where no `srun` is found): called here, in this one place, for the dry run.
    from submitit.slurm.slurm import _make_sbatch_string  # the optional slurm extra

    folder = folder_of(cfg, out)
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, map_count=tasks, **sbatch_parameters(cfg))


def dry_run(cfg, specs: list[RunSpec], *, out: Path) -> Outcome:
    tasks = chunks(specs, cfg.runs_per_task)
    if not tasks:
        print("sweep: nothing to submit: every run is finished")
        return Outcome(dry_run=True)
    print(f"# launcher=slurm dry run: {len(specs)} run(s) in an array of {len(tasks)} task(s), "
          f"{cfg.runs_per_task} run(s) per task; this sbatch script would be submitted:\n")
    print(submission_text(cfg, out, len(tasks)))
    for i, task in enumerate(tasks):
        print(f"# task {i}: " + ", ".join(s.dir for s in task))
    return Outcome(dry_run=True)


class OnceFilter(logging.Filter):
    """Let each distinct message through once (numbers ignored: submitit's "Call #7 - Bypassing sacct error ..."
    is the same warning at every poll)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = re.sub(r"\d+", "#", record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        if "Bypassing sacct error" in key:
            log.warning("sweep: sacct does not answer on this cluster (accounting storage off?); fewclip follows the "
                        "array tasks with squeue and their result files instead")
        return True


def quiet_submitit() -> None:
    """submitit's log through fewclip's handler only (its own handlers print each record to stdout and stderr,
    and the root logger a third time), each distinct warning once. Done once per process."""
    logger = logging.getLogger("submitit")
    if any(isinstance(f, OnceFilter) for f in logger.filters):
        return
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.setLevel(logging.WARNING)
    logger.propagate = True
    logger.addFilter(OnceFilter())


def executor(cfg, out: Path):
    submitit = require_extra("slurm")
    quiet_submitit()
    folder = folder_of(cfg, out)
    if cfg.cluster == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=cfg.time_min)
        return ex
    try:
        ex = submitit.SlurmExecutor(folder=folder)
    except RuntimeError:
        raise LauncherError("launcher=slurm needs SLURM's srun and sbatch on PATH: run fewclip sweep on the "
                            "cluster's login node (launcher.dry_run=true prints the submission here; "
                            "launcher.cluster=local runs the same tasks on this machine)") from None
    ex.update_parameters(**sbatch_parameters(cfg))
    return ex


def run_slurm(cfg, specs: list[RunSpec], progress: SweepProgress, *, out: Path, poll_s: float = 5.0) -> None:
    tasks = chunks(specs, cfg.runs_per_task)
    if not tasks:
        return
    ex = executor(cfg, out)
    if cfg.cluster == "slurm":
        threads = cfg.cpus_per_task
    else:  # the local executor starts every task at once: share this machine's CPUs

        threads = max(1, cpu_count() // len(tasks))
    jobs = ex.map_array(run_many, tasks, [threads] * len(tasks))
    log.info("sweep: submitted %d array task(s) (%s), %d run(s) each; submitit's files: %s", len(jobs),
             jobs[0].job_id.split("_")[0] if jobs else "-", cfg.runs_per_task, folder_of(cfg, out))
    pending = dict(zip(range(len(jobs)), zip(jobs, tasks)))
    gone: dict[int, int] = {}  # task -> polls it has been missing from the queue without a result
    try:
        while pending:
            queued = queued_tasks(jobs[0].job_id.split("_")[0]) if cfg.cluster == "slurm" else None
            for i, (job, task) in list(pending.items()):
                if has_result(job):
                    ended = True
                elif queued is None:  # submitit's local executor, or squeue did not answer: ask submitit
                    ended = job.done() if cfg.cluster == "local" else False
                else:  # left the queue without a result: twice in a row, so a result file being written is seen
                    gone[i] = gone.get(i, 0) + 1 if job.job_id not in queued else 0
                    ended = gone[i] >= 2
                if not ended:
                    continue
                del pending[i]
                for r in _results(job, task):
                    progress.finished(r)
            if pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        log.warning("sweep: stopped waiting; the %d array task(s) still queued or running go on (scancel %s to "
                    "stop them)", len(pending), jobs[0].job_id.split("_")[0])
        raise


def has_result(job) -> bool:
    try:
        return Path(job.paths.result_pickle).exists()
    except Exception:  # submitit's job paths can raise for a job it no longer knows: no result
        return False


def queued_tasks(array_id: str) -> Optional[set[str]]:
    """The tasks (``ARRAY_TASK``) of the array job ``array_id`` that SLURM still holds (pending, running,
    completing), or None where squeue does not answer."""
    try:
        p = subprocess.run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i"], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return set() if "invalid job id" in (p.stderr or "").lower() else None
    return {line.strip() for line in p.stdout.splitlines() if line.strip()}


def _results(job, task: list[RunSpec]) -> list[RunResult]:
    """A task's results, or, for a task that ended without them (cancelled, out of time), what its runs left."""
    reason = "it left the queue without a result (cancelled, out of time, or its node failed)"
    if has_result(job) or job.done():
        try:
            return list(job.result())
        except Exception as e:  # submitit's FailedJobError, UncompletedJobError, ...
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    stderr = str(getattr(getattr(job, "paths", None), "stderr", "") or "")
    out = []
    for spec in task:
        state = run_state(spec.path, spec.identity)
        if state.finished:
            m = state.metrics or {}
            out.append(RunResult(spec, "ran", top1=m.get("top1"), wall_time_s=m.get("wall_time_s"),
                                 worker=f"task {job.job_id}"))
        else:
            out.append(RunResult(spec, "failed", worker=f"task {job.job_id}", log=stderr or str(spec.path / "run.log"),
                                 error=f"SLURM task {job.job_id} ended without finishing it: {reason}"))
    return out


register_launcher(Launcher("slurm", SlurmConfig, lambda cfg, specs, progress, *, out, context=None, poll_s=1.0:
                           run_slurm(cfg, list(specs), progress, out=out, poll_s=max(poll_s, 2.0)),
                           describe_slurm, dry_run=lambda cfg, specs, *, out: dry_run(cfg, list(specs), out=out)))
