"""Logging: fewclip's own lines at the chosen level, third-party chatter kept out of the user's terminal.

Two rules, each set in one place:

- ``setup_logging(level)`` (the command line's, once per command): the handler sits on the root
  logger at WARNING, so libraries' INFO lines (open_clip logs every step of building a model on
  the root logger; transformers, huggingface_hub) do not reach the terminal, and the
  ``fewclip`` logger alone is set to ``level``.
- ``quiet_open_clip()``: while fewclip builds a model or a tokenizer with open_clip, a filter on
  the root logger drops open_clip's records below ERROR. open_clip would say "No pretrained
  weights loaded ... initialized randomly" for a model whose weights fewclip loads itself right
  after; fewclip logs its own line for the weights it loaded instead (``backbones``). The filter
  is added for the call and removed after it: nothing process-wide is changed.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from importlib.util import find_spec

THIRD_PARTY_LEVEL = logging.WARNING


def setup_logging(level: str = "info") -> None:
    """Log fewclip's lines at ``level`` to stderr; other libraries' only from WARNING up (or ``level`` if higher)."""
    lvl = getattr(logging, level.upper())
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=max(lvl, THIRD_PARTY_LEVEL), force=True)
    logging.getLogger("fewclip").setLevel(lvl)


def _open_clip_dir() -> str:
    """open_clip's package folder, found without importing it (this module stays light for the command line)."""
    return os.path.dirname(os.path.abspath(find_spec("open_clip").origin)) + os.sep


class _DropOpenClip(logging.Filter):
    """Drops the records that open_clip's own modules log below ERROR."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not os.path.abspath(record.pathname).startswith(self.folder)


@contextlib.contextmanager
def quiet_open_clip() -> Iterator[None]:
    """Within the block, open_clip's log records below ERROR are dropped (open_clip logs on the root logger)."""
    root = logging.getLogger()
    f = _DropOpenClip(_open_clip_dir())
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def quiet(name: str, below: int = logging.WARNING) -> Iterator[None]:
    """Within the block, the records logged on logger ``name`` below ``below`` are dropped (e.g. the load-back of
    a card ``fewclip import`` is writing: its summary says what was loaded, about the user's file)."""
    logger = logging.getLogger(name)
    f = _Below(below)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)
