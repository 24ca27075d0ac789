"""What the launching terminal shows while a sweep's runs execute, wherever they execute: one line per
finished run, and an overall bar (runs done, failed, left, the time to go)."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from fewclip.runs.launch.worker import RunResult
from fewclip.utils.progress import progress

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a launcher did: counts by status, the failed runs (with their logs), whether it was a dry run."""

    counts: dict[str, int] = field(default_factory=lambda: {"ran": 0, "rerun": 0, "by_others": 0, "failed": 0})
    failures: list[RunResult] = field(default_factory=list)
    dry_run: bool = False


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def time_to_go(remaining: Sequence[str], walls: dict[str, list[float]], busy_s: float, elapsed_s: float) -> float:
    """Seconds until the ``remaining`` runs (their method labels) finish, learnt from the runs done: each
    remaining run takes its method's mean wall time so far (the mean over all methods where its method has not
    run yet), and the launcher gets through ``busy_s`` seconds of run time per ``elapsed_s`` seconds (its
    parallelism, start-up included)."""
    done = [w for ws in walls.values() for w in ws]
    if not done or elapsed_s <= 0:
        return float("nan")
    overall = sum(done) / len(done)
    work = sum(sum(walls[m]) / len(walls[m]) if walls.get(m) else overall for m in remaining)
    parallel = max(busy_s / elapsed_s, 1e-9)
    return work / parallel


class SweepProgress:
    """Counts the results a launcher reports and prints them (``finished``); ``close`` at the end. The time to go
    is printed once a run has finished (no estimate without evidence), from ``time_to_go``."""

    def __init__(self, total: int, launcher: str = "", specs: Sequence = ()):
        self.total = total
        self.pending = {getattr(s, "dir", i): getattr(s, "method", "") for i, s in enumerate(specs)}
        self.walls: dict[str, list[float]] = {}
        self.busy_s = 0.0
        self.result = Outcome()
        self.t0 = time.monotonic()
        self.bar = progress(total=total, desc="sweep", unit="run")
        if total:
            log.info("sweep: %d run(s) to execute on %s", total, launcher or "this process")

    @property
    def finished_count(self) -> int:
        c = self.result.counts
        return c["ran"] + c["by_others"] + c["failed"]

    def finished(self, r: RunResult) -> None:
        c = self.result.counts
        if r.status == "rerun":
            c["ran"] += 1
            c["rerun"] += 1
        else:
            c[r.status] += 1
        if r.status == "failed":
            self.result.failures.append(r)
        self.pending.pop(r.spec.dir, None)
        if r.wall_time_s is not None and r.status in ("ran", "rerun"):
            self.walls.setdefault(r.spec.method, []).append(float(r.wall_time_s))
            self.busy_s += float(r.wall_time_s)
        n = self.finished_count
        left = self.total - n
        elapsed = time.monotonic() - self.t0
        eta = ""
        if left and self.pending:
            togo = time_to_go(list(self.pending.values()), self.walls, self.busy_s, elapsed)
            eta = f", about {_duration(togo)} to go" if togo == togo else ""  # nan: no run time measured yet
        elif left and n:
            eta = f", about {_duration(elapsed / n * left)} to go"
        if r.status == "failed":
            what = f"FAILED {r.spec.label}: {r.error} (log: {r.log})"
        elif r.status == "by_others":
            what = f"done by another worker: {r.spec.label}"
        else:
            top1 = f"top-1 {r.top1:.2f}%" if r.top1 is not None else "finished"
            took = f" in {r.wall_time_s:.1f} s" if r.wall_time_s is not None else ""
            what = f"{r.spec.label}: {top1}{took} [{r.worker}]"
        log.info("[%d/%d] %s | %d done, %d failed, %d left%s", n, self.total, what, c["ran"] + c["by_others"],
                 c["failed"], left, eta)
        self.bar.set_postfix_str(f"done {c['ran'] + c['by_others']}, failed {c['failed']}, left {left}", refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()

    def outcome(self) -> Outcome:
        return self.result
