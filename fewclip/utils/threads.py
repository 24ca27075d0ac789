"""How many CPU threads each fewclip process computes with, chosen by fewclip rather than left to torch.

torch's default is one thread per core in every process; two processes (a sweep's workers, or a run beside
other work) then fight over the cores and each runs many times slower than with fewer threads. fewclip
chooses the cores this process may use divided by the processes working at once, unless the user chose: the
run config's ``threads=N`` first, then the environment's ``OMP_NUM_THREADS``. The choice is logged in a run's
first line and recorded in its metrics.json (``threads``, ``threads_chosen_by``).
"""
from __future__ import annotations

import os
from typing import Optional

ENV = "OMP_NUM_THREADS"
_chosen: dict[str, object] = {"n": None, "by": None}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM or container limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose(workers: int = 1, setting: Optional[int] = None) -> tuple[int, str]:
    """``(threads, why)``: ``setting`` (the config's ``threads``) when given, else ``OMP_NUM_THREADS`` when set
    to a positive whole number, else the usable cores divided by ``workers`` (at least 1)."""
    if setting:
        return int(setting), "threads="
    env = os.environ.get(ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), ENV
    cores = usable_cores()
    workers = max(1, int(workers))
    why = f"{cores} core(s)" + (f" / {workers} workers" if workers > 1 else "")
    return max(1, cores // workers), why


def apply(threads: int, why: str) -> int:
    """Set this process's torch threads to ``threads`` and remember why (for :func:`words` and :func:`record`)."""
    import torch  # here, so that choosing stays torch-free

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _chosen.update(n=threads, by=why)
    return threads


def settle(workers: int = 1, setting: Optional[int] = None) -> int:
    """Choose and apply (a run's or worker's start); a choice already applied in this process is kept unless
    ``setting`` names another number."""
    if _chosen["n"] is not None and not setting:
        return int(_chosen["n"])
    return apply(*choose(workers, setting))


def record() -> dict[str, object]:
    """What metrics.json keeps: the threads this process computes with and what chose them."""
    import torch

    n = torch.get_num_threads()
    by = _chosen["by"] if _chosen["n"] == n else "torch's default"
    return {"threads": n, "threads_chosen_by": by}


def words() -> str:
    """The choice in a few words for a run's first line."""
    r = record()
    hint = "" if r["threads_chosen_by"] in ("threads=", ENV) else f"; threads=N or {ENV}=N to change"
    return f"{r['threads']} CPU thread(s) ({r['threads_chosen_by']}{hint})"
