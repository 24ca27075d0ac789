"""``launcher=ray``: each run a Ray task (``pip install "fewclip[ray]"``).

``launcher.address=auto`` joins the running cluster (``ray start --head`` on one node, ``ray start
--address=HEAD:6379`` on the others), an address joins that one, and null starts a local cluster for the
sweep with ``launcher.cpus`` CPUs (or joins the one this process already started, as a test does with
``ray.init(num_cpus=2)``). A task asks for ``launcher.cpus_per_run`` CPUs and ``launcher.gpus_per_run``
GPUs, whole GPUs for a method that trains the image tower (``fewclip.runs.launch.gpus_for``), and runs
``execute_run`` in a Ray worker process, which keeps its loaded backbones and feature cache for its next
tasks. Every node needs the same fewclip and the sweep's out directory and feature store on a shared
filesystem. Worker output goes to each run's ``run.log``, not to the launching terminal.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

from fewclip.config.sections import RayConfig
from fewclip.runs.launch.base import Launcher, LauncherError, gpus_for, register_launcher, require_extra
from fewclip.runs.launch.progress import SweepProgress
from fewclip.runs.launch.worker import RunResult, RunSpec, execute_run, worker_setup

log = logging.getLogger(__name__)
NICENESS_ENV = "RAY_worker_niceness"  # Ray's setting (ray._private.ray_constants.RAY_WORKER_NICENESS)


@contextmanager
def worker_niceness(niceness: int):
    """The niceness of the worker processes of a Ray cluster started inside (Ray reads it from the environment of
    the processes ``ray.init`` starts, ``RAY_worker_niceness``; set only for that call, then put back as it was).

    Why: Ray starts its workers at niceness 15, so beside any other job on the machine they get almost no CPU.
    Measured on this project's 2-core CPU beside two single-thread jobs (load about 3): importing fewclip's methods
    in two Ray workers took 128 s at 15 and 7.6 s at 0."""
    before = os.environ.get(NICENESS_ENV)
    os.environ[NICENESS_ENV] = str(int(niceness))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NICENESS_ENV, None)
        else:
            os.environ[NICENESS_ENV] = before


def describe_ray(cfg: RayConfig) -> str:
    return f"Ray ({cfg.address or 'a local cluster'})"


def _task(spec: RunSpec, threads: int) -> RunResult:
    """What a Ray task runs."""
    worker_setup(threads, spec.log_level)
    return execute_run(spec)


def run_ray(cfg, specs: list[RunSpec], progress: SweepProgress, poll_s: float = 1.0) -> None:
    ray = require_extra("ray")
    started = False
    if not ray.is_initialized():
        kwargs = dict(log_to_driver=False, include_dashboard=False)
        if cfg.address:
            ray.init(address=cfg.address, **kwargs)
        else:
            with worker_niceness(cfg.worker_niceness):
                ray.init(num_cpus=cfg.cpus, **kwargs)
            started = True
    resources = ray.cluster_resources()
    log.info("sweep: Ray cluster with %g CPU(s) and %g GPU(s); %g CPU(s) and %g GPU(s) per run",
             resources.get("CPU", 0), resources.get("GPU", 0), cfg.cpus_per_run, cfg.gpus_per_run)
    if cfg.gpus_per_run > resources.get("GPU", 0):
        raise LauncherError(f"launcher.gpus_per_run={cfg.gpus_per_run} but the Ray cluster has "
                            f"{resources.get('GPU', 0):g} GPU(s); lower it (0: CPU only)")
    remote = ray.remote(_task)
    threads = max(1, int(cfg.cpus_per_run))

    def submit(spec: RunSpec):
        return remote.options(num_cpus=cfg.cpus_per_run, num_gpus=gpus_for(cfg, spec.trains_image_tower),
                              max_retries=cfg.max_retries, retry_exceptions=False).remote(spec, threads)

    running: dict[object, RunSpec] = {}
    later: list = []  # (not before, spec): runs held by another launcher
    queue = list(specs)
    try:
        for spec in queue:
            running[submit(spec)] = spec
        while running or later:
            now = time.monotonic()
            for t, spec in [x for x in later if x[0] <= now]:
                later.remove((t, spec))
                running[submit(spec)] = spec
            if not running:
                time.sleep(poll_s)
                continue
            ready, _ = ray.wait(list(running), num_returns=1, timeout=poll_s)
            for ref in ready:
                spec = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:  # the worker died (killed, out of memory) or Ray failed
                    reason = type(e).__name__
                    result = RunResult(spec, "failed", log=str(spec.path / "run.log"),
                                       error=f"its Ray task ended without a result ({reason}: the worker process "
                                             f"died or was killed during the run)")
                if result.status == "busy":
                    later.append((time.monotonic() + poll_s, spec))
                else:
                    progress.finished(result)
    finally:
        for ref in running:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


register_launcher(Launcher("ray", RayConfig, lambda cfg, specs, progress, *, out, context=None, poll_s=1.0:
                           run_ray(cfg, list(specs), progress, poll_s=poll_s), describe_ray))
