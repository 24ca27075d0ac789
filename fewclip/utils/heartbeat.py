"""A heartbeat for long work: whatever the load, fewclip's log is never silent for longer than the progress
interval (:func:`line_every`, 10 s by default) while a step is under way.

The work announces its steps (``with step("loading the backbone RN50"):``); a daemon thread, not the work's own
loop, watches fewclip's log and, when nothing was written for most of the interval, writes one line naming the
innermost step, how long it has run and, for a progress-tracked phase, where it stands::

    12:00:10 INFO fewclip.utils.heartbeat: features: encoding 64 images with RN50: still working, 10 s so far (0/1 batch)

A step that ends after the heartbeat spoke of it gets a closing line with its duration. Steps too short to be
worth a line (``announce=False``) say nothing unless they run long. The heartbeat is a thread so that a single
slow call (one batch of a large tower on a busy CPU, ``torch.compile``'s first step, loading a checkpoint) that
the work's loop cannot interrupt is still reported: torch releases the GIL in its kernels.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

from fewclip.utils import env

log = logging.getLogger("fewclip.utils.heartbeat")

# A line at least this often during long work without a terminal (FEWCLIP_PROGRESS_EVERY_S overrides).
LINE_EVERY_S = 10.0
EVERY_ENV = env.PROGRESS_EVERY_S

# A line is due after this share of the interval without one (a progress line at the end of a unit of work, or
# else the heartbeat's), so that the interval is an upper bound on the silence, not its usual length.
SPEAK_AT = 0.9


@dataclass
class _Step:
    what: str
    started: float
    where: Optional[Callable[[], str]] = None  # where a progress-tracked phase stands ("3/30 step")
    spoken: bool = False
    thread: int = field(default_factory=threading.get_ident)


class _Stamp(logging.Handler):
    """On the ``fewclip`` logger: notes the time of every line written, so the heartbeat speaks only into silence."""

    def __init__(self, beat: Heartbeat):
        super().__init__(level=logging.NOTSET)
        self.beat = beat

    def emit(self, record: logging.LogRecord) -> None:
        self.beat.last_line = time.monotonic()


class Heartbeat:
    """The process's heartbeat: a stack of steps under way and a thread that speaks when the log is silent."""

    def __init__(self):
        self.steps: list[_Step] = []
        self.lock = threading.Lock()
        self.last_line = time.monotonic()
        self.thread: Optional[threading.Thread] = None
        self.stamp = _Stamp(self)

    def _every(self) -> float:
        return line_every()

    def _ensure_thread(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
        logger = logging.getLogger("fewclip")
        if self.stamp not in logger.handlers:
            logger.addHandler(self.stamp)
        self.thread = threading.Thread(target=self._run, name="fewclip-heartbeat", daemon=True)
        self.thread.start()

    def push(self, step: _Step) -> None:
        with self.lock:
            self.steps.append(step)
        self._ensure_thread()

    def pop(self, step: _Step) -> bool:
        """Remove ``step`` and the steps its thread began within it and left open (a progress bar an error
        left unclosed must not be named after its run); False if it was not under way (ended twice)."""
        with self.lock:
            if step not in self.steps:
                return False
            at = self.steps.index(step)
            self.steps[at:] = [s for s in self.steps[at + 1:] if s.thread != step.thread]
            return True

    def _run(self) -> None:
        while True:
            every = self._every()
            time.sleep(max(0.02, min(0.5, every / 20)))
            with self.lock:
                current = self.steps[-1] if self.steps else None
            if current is None:
                continue
            now = time.monotonic()
            if now - self.last_line >= SPEAK_AT * every:
                where = ""
                if current.where is not None:
                    try:
                        where = f" ({current.where()})"
                    except Exception:  # a progress object being closed: say the rest
                        where = ""
                current.spoken = True
                log.info("%s: still working, %s so far%s", current.what, _duration(now - current.started), where)
                self.last_line = time.monotonic()


_BEAT = Heartbeat()


def line_due() -> bool:
    """Whether fewclip's log has been silent long enough for a progress line (see ``SPEAK_AT``)."""
    _BEAT._ensure_thread()  # the stamp handler must be in place for this to mean anything
    return time.monotonic() - _BEAT.last_line >= SPEAK_AT * _BEAT._every()


def begin(what: str, *, where: Optional[Callable[[], str]] = None) -> _Step:
    """A step under way until :func:`end` (for work that is not one block: a progress object)."""
    s = _Step(what, time.monotonic(), where)
    _BEAT.push(s)
    return s


def end(s: _Step, logger: logging.Logger = log, *, quiet: bool = False) -> None:
    """The step is over; if the heartbeat spoke of it, a closing line with its duration (``quiet``: the caller
    writes its own)."""
    if _BEAT.pop(s) and s.spoken and not quiet:
        logger.info("%s: done in %s", s.what, _duration(time.monotonic() - s.started))


@contextlib.contextmanager
def step(what: str, *, announce: bool = True, where: Optional[Callable[[], str]] = None,
         logger: logging.Logger = log) -> Iterator[None]:
    """Within the block, the heartbeat names ``what`` when fewclip's log has been silent for most of the interval.
    ``announce``: log ``what`` on the way in and ``what: done in T`` on the way out; otherwise the closing line
    comes only if the heartbeat spoke of the step (it ran long). ``where``: a callable saying where it stands."""
    if announce:
        logger.info("%s", what)
    s = begin(what, where=where)
    if announce:
        s.spoken = True  # its closing line is due whatever its length
    try:
        yield
    finally:
        end(s, logger)


def _duration(s: float) -> str:
    return duration(s) if s >= 1 else f"{s:.1f} s"


def line_every() -> float:
    """Seconds between plain progress lines (``LINE_EVERY_S``, or the environment's ``FEWCLIP_PROGRESS_EVERY_S``)."""
    try:
        value = float(os.environ.get(EVERY_ENV, LINE_EVERY_S))
    except ValueError:
        return LINE_EVERY_S
    return value if value > 0 else LINE_EVERY_S


def duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"
