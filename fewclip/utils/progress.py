"""Progress of long work, in every mode: a tqdm bar on an interactive terminal, plain throttled log lines
elsewhere (``nohup``, SLURM and Ray logs), so no long phase is silent; a slow unit of work (one batch, one
step) is covered by the heartbeat (``fewclip.utils.heartbeat``), a thread that speaks when the log is silent.

``progress(iterable, desc=..., total=...)`` is a tqdm object either way. Without a terminal (or with bars
turned off in a sweep's worker processes, whose launching terminal shows the sweep's bar) it draws no bar
but logs ``desc: n/total (rate, time left)`` when the log has been silent for most of ``LINE_EVERY_S`` seconds, and once at the end of a
phase that took longer than that. ``quiet_bars()`` turns bars off for this process (a sweep worker).
"""
from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

from fewclip.utils.heartbeat import EVERY_ENV, LINE_EVERY_S, line_due, line_every  # noqa: F401 (also here)
from fewclip.utils.heartbeat import begin as begin_step
from fewclip.utils.heartbeat import duration as _duration
from fewclip.utils.heartbeat import end as end_step

log = logging.getLogger("fewclip.utils.progress")

_bars = {"on": True}


def quiet_bars(quiet: bool = True) -> None:
    """No progress bars in this process (plain lines still go to the log)."""
    _bars["on"] = not quiet


def bars_shown() -> bool:
    """Whether this process draws bars: an interactive stderr, bars not turned off, log level info or lower."""
    return (_bars["on"] and sys.stderr.isatty()
            and logging.getLogger("fewclip").getEffectiveLevel() <= logging.INFO)


class _Lines(tqdm):
    """A tqdm that draws nothing and logs a plain line every ``LINE_EVERY_S`` seconds instead."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = False
        kwargs["file"] = _Null()
        kwargs["mininterval"] = 0.0
        super().__init__(*args, **kwargs)
        self._started = time.monotonic()
        self._last_line = self._started
        self._every = line_every()

    def update(self, n=1):
        out = super().update(n)
        if line_due():  # the log's silence, not this bar's alone: one line per interval in all
            self._last_line = time.monotonic()
            self._line()
        return out

    def close(self):
        if not self.disable and getattr(self, "_last_line", None) is not None:
            if self._last_line != self._started or time.monotonic() - self._started >= self._every:
                self._line(done=True)
            self._last_line = None
        super().close()

    def _line(self, done: bool = False) -> None:
        elapsed = time.monotonic() - self._started
        total = f"/{self.total}" if self.total else ""
        rate = self.n / elapsed if elapsed > 0 else 0.0
        left = ""
        if not done and self.total and rate > 0:
            left = f", about {_duration((self.total - self.n) / rate)} left"
        unit = self.unit or "it"
        post = f" {self.postfix}" if self.postfix else ""
        state = "done" if done else "at"
        log.info("%s: %s %d%s %s in %s (%.2f %s/s%s)%s", self.desc or "working", state, self.n, total, unit,
                 _duration(elapsed), rate, unit, left, post)


class _Null:
    def write(self, s):
        pass

    def flush(self):
        pass


def progress(iterable=None, **kwargs) -> tqdm:
    """A bar on an interactive terminal; plain throttled log lines otherwise (module docstring). Either way the
    phase is a heartbeat step (``fewclip.utils.heartbeat``): one slow unit of it (a batch, a step) is not silent."""
    bar = tqdm(iterable, **kwargs) if bars_shown() else _Lines(iterable, **kwargs)
    beat = begin_step(bar.desc or "working",
                           where=lambda: f"at {bar.n}{f'/{bar.total}' if bar.total else ''} {bar.unit or 'it'}")
    close = bar.close

    def closing():
        end_step(beat, quiet=not bars_shown())  # the plain lines close with their own "done" line
        close()

    bar.close = closing
    return bar
