"""``launcher=local``: the runs execute in this process (``launcher.workers=1``) or in N worker processes.

Worker processes are started with ``spawn`` (a fresh interpreter: no forked torch or CUDA state), each
with its own GPU where there are GPUs (worker i: GPU i modulo their number, through
``CUDA_VISIBLE_DEVICES``), or with a share of the CPU threads where there are none. The launcher hands
each idle worker the next run over a pipe, so it always knows which run a worker holds: a worker that
dies (killed, out of memory) has its run reported failed and is replaced. A run held by another launcher
is tried again after the others.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Optional

import torch

from fewclip.config.sections import LocalConfig
from fewclip.runs.launch.base import Launcher, register_launcher
from fewclip.runs.launch.progress import SweepProgress
from fewclip.runs.launch.worker import RunResult, RunSpec, WorkerContext, execute_run, worker_setup
from fewclip.utils.threads import choose as choose_threads

log = logging.getLogger(__name__)


def describe_local(cfg: LocalConfig) -> str:
    return "this process" if cfg.workers == 1 else f"{cfg.workers} local worker processes"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else every CUDA device."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA driver makes torch raise (RuntimeError...): no GPU to use
        return []


def run_local(cfg, specs: list[RunSpec], progress: SweepProgress, *, context: Optional[WorkerContext] = None,
              poll_s: float = 1.0) -> None:
    if cfg.workers == 1:
        return _in_process(specs, progress, context, poll_s)
    return _in_workers(cfg.workers, specs, progress, poll_s)


def _in_process(specs: list[RunSpec], progress: SweepProgress, context: Optional[WorkerContext],
                poll_s: float) -> None:
    """One run after another in this process; runs held by other workers are tried again after the rest."""
    pending, said = list(specs), None
    while pending:
        waiting = []
        for spec in pending:
            ctx = context if context is not None and context.store_root == spec.store else None
            r = execute_run(spec, ctx)
            if r.status == "busy":
                waiting.append(spec)
            else:
                progress.finished(r)
        if waiting and len(waiting) == len(pending):
            if said is None or time.monotonic() - said > 60:  # say it once a minute
                log.info("sweep: waiting for %d run(s) held by other workers (e.g. %s)", len(waiting), waiting[0].dir)
                said = time.monotonic()
            time.sleep(poll_s)
        pending = waiting


# ---------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------


def _worker_main(conn, gpu: Optional[str], threads: int, log_level: str, why: str = "the launcher") -> None:
    """A worker process: runs the specs it receives until it receives None."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    worker_setup(threads, log_level, why)
    try:
        while True:
            spec = conn.recv()
            if spec is None:
                break
            conn.send(execute_run(spec))
    except (EOFError, KeyboardInterrupt):  # the launcher is gone, or Ctrl-C reached the whole process group
        pass


@dataclass
class _Worker:
    slot: int
    gpu: Optional[str]
    process: object
    conn: object
    spec: Optional[RunSpec] = None


def _in_workers(n: int, specs: list[RunSpec], progress: SweepProgress, poll_s: float) -> None:

    ctx = mp.get_context("spawn")
    gpus = visible_gpus()
    threads, why = choose_threads(workers=n)  # OMP_NUM_THREADS when set, else the cores shared out
    log_level = specs[0].log_level if specs else "info"
    if gpus:
        log.info("sweep: %d workers on %d GPU(s) (%s), %d CPU thread(s) each", n, len(gpus), ",".join(gpus), threads)
    else:
        log.info("sweep: %d workers on the CPU, %d thread(s) each (%s)", n, threads, why)

    def start(slot: int) -> _Worker:
        gpu = gpus[slot % len(gpus)] if gpus else None
        here, there = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(there, gpu, threads, log_level, why), name=f"fewclip-worker-{slot}",
                        daemon=True)
        p.start()
        there.close()
        return _Worker(slot, gpu, p, here)

    queue: deque[tuple[float, RunSpec]] = deque((0.0, s) for s in specs)  # (not before, spec)
    workers = [start(i) for i in range(min(n, len(specs)))]
    said = None
    try:
        while queue or any(w.spec is not None for w in workers):
            now = time.monotonic()
            for w in workers:  # hand out work
                if w.spec is None and queue and queue[0][0] <= now:
                    _, w.spec = queue.popleft()
                    try:
                        w.conn.send(w.spec)
                    except (BrokenPipeError, OSError):
                        pass  # a dead worker: found below
            busy = [w for w in workers if w.spec is not None]
            if not busy:  # everything left is held by other launchers: wait before trying again
                if said is None or now - said > 60:
                    log.info("sweep: waiting for %d run(s) held by other workers (e.g. %s)", len(queue), queue[0][1].dir)
                    said = now
                time.sleep(max(0.0, min(poll_s, queue[0][0] - now)))
                continue
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=poll_s)
            for w in busy:
                result = None
                if w.conn in ready:
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        result = None
                if result is None and w.process.sentinel not in ready and w.process.is_alive():
                    continue
                if result is None:  # the worker died during the run
                    w.process.join(timeout=5)
                    code = w.process.exitcode
                    result = RunResult(w.spec, "failed", log=str(w.spec.path / "run.log"),
                                       error=f"its worker process (pid {w.process.pid}) died during the run "
                                             f"(exit code {code}{': killed' if code is not None and code < 0 else ''})")
                    workers.remove(w)
                    if queue:  # a fresh worker in its place
                        workers.append(start(w.slot))
                    progress.finished(result)
                    continue
                spec, w.spec = w.spec, None
                if result.status == "busy":
                    queue.append((time.monotonic() + poll_s, spec))
                else:
                    progress.finished(result)
    finally:
        for w in workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(timeout=5)


register_launcher(Launcher("local", LocalConfig, lambda cfg, specs, progress, *, out, context=None, poll_s=1.0:
                           run_local(cfg, list(specs), progress, context=context, poll_s=poll_s), describe_local))
