"""Progress of long work, in every mode: a tqdm bar on an interactive terminal, plain throttled log lines
elsewhere (``nohup``, SLURM and Ray logs), so no long phase is silent.

``progress(iterable, desc=..., total=...)`` is a tqdm object either way. Without a terminal (or with bars
turned off in a sweep's worker processes, whose launching terminal shows the sweep's bar) it draws no bar
but logs ``desc: n/total (rate, time left)`` at most every ``LINE_EVERY_S`` seconds, and once at the end of a
phase that took longer than that. ``quiet_bars()`` turns bars off for this process (a sweep worker).
"""
from __future__ import annotations

import logging
import os
import sys
import time

from tqdm.auto import tqdm
from fewclip.utils import env

log = logging.getLogger("fewclip.utils.progress")

# A plain line at least this often during long work without a terminal (FEWCLIP_PROGRESS_EVERY_S overrides).
LINE_EVERY_S = 10.0
EVERY_ENV = env.PROGRESS_EVERY_S
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
        now = time.monotonic()
        if now - self._last_line >= self._every:
            self._last_line = now
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


def line_every() -> float:
    """Seconds between plain progress lines (``LINE_EVERY_S``, or the environment's ``FEWCLIP_PROGRESS_EVERY_S``)."""
    try:
        value = float(os.environ.get(EVERY_ENV, LINE_EVERY_S))
    except ValueError:
        return LINE_EVERY_S
    return value if value > 0 else LINE_EVERY_S


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def progress(iterable=None, **kwargs) -> tqdm:
    """A bar on an interactive terminal; plain throttled log lines otherwise (module docstring)."""
    if bars_shown():
        return tqdm(iterable, **kwargs)
    return _Lines(iterable, **kwargs)
