"""Never silent while one unit of work is slow (issue 36, item 4): the heartbeat thread speaks, not the work."""
from __future__ import annotations

import logging
import time

from fewclip.utils import heartbeat
from fewclip.utils.progress import progress


class _Times(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((time.monotonic(), record.name, record.getMessage()))


def _watch(monkeypatch, every: float = 0.3):
    monkeypatch.setenv("FEWCLIP_PROGRESS_EVERY_S", str(every))
    logger = logging.getLogger("fewclip")
    times = _Times()
    logger.addHandler(times)
    monkeypatch.setattr(logger, "level", logging.INFO)
    return logger, times


def test_one_slow_call_inside_a_step_is_reported_before_and_after(monkeypatch):
    """A single call the work's loop cannot interrupt (here a sleep; a batch of a large tower, a compile)."""
    logger, times = _watch(monkeypatch)
    try:
        start = time.monotonic()
        with heartbeat.step("loading the backbone big-one"):
            time.sleep(1.5)
        end = time.monotonic()
    finally:
        logger.removeHandler(times)
    text = [m for _, _, m in times.lines]
    assert text[0] == "loading the backbone big-one" and text[-1].startswith("loading the backbone big-one: done in")
    beats = [(t, m) for t, name, m in times.lines if name == "fewclip.utils.heartbeat" and "still working" in m]
    assert len(beats) >= 2, text  # 1.5 s at a 0.3 s interval: several, whatever the load (a loaded core: fewer)
    stamps = [start] + [t for t, _, _ in times.lines] + [end]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 1.5, text  # 5 intervals: only a starved process waits


def test_a_slow_first_batch_is_named_with_where_the_phase_stands(monkeypatch):
    logger, times = _watch(monkeypatch)
    try:
        for _ in progress(range(2), desc="RN50 test features", unit="batch"):
            time.sleep(0.8)  # no unit ends within the interval: only the heartbeat can speak
    finally:
        logger.removeHandler(times)
    beats = [m for _, name, m in times.lines if name == "fewclip.utils.heartbeat"]
    assert beats and beats[0].startswith("RN50 test features: still working") and "(at 0/2 batch)" in beats[0], beats


def test_a_short_quiet_step_says_nothing_and_a_finished_step_is_not_named_again(monkeypatch):
    logger, times = _watch(monkeypatch, every=5.0)
    try:
        with heartbeat.step("encoding 3 images", announce=False):
            pass
        assert heartbeat._BEAT.steps == [] and times.lines == []
    finally:
        logger.removeHandler(times)


def test_a_step_left_open_by_an_error_ends_with_the_step_around_it(monkeypatch):
    """A progress bar an exception left unclosed is not named by the heartbeat after its run has ended."""
    _, times = _watch(monkeypatch, every=5.0)
    logging.getLogger("fewclip").removeHandler(times)
    try:
        with heartbeat.step("run out/x", announce=False):
            bar = progress(range(3), desc="train coop", unit="step")
            next(iter(bar))
            raise RuntimeError("diverged")
    except RuntimeError:
        pass
    assert heartbeat._BEAT.steps == []
    bar.close()  # closing it later is harmless
    assert heartbeat._BEAT.steps == []
