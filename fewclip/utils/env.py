"""The environment variables fewclip reads: each declared once here, with what it does and its default.

``fewclip --help`` lists them (:func:`describe_environment`), and each module that reads one takes its name from
here, so a variable cannot be read under two spellings or go unlisted.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str


CACHE = "FEWCLIP_CACHE"
CACHE_VERIFY = "FEWCLIP_CACHE_VERIFY"
DEBUG = "FEWCLIP_DEBUG"
LOCK_TIMEOUT_S = "FEWCLIP_LOCK_TIMEOUT_S"
PROGRESS_EVERY_S = "FEWCLIP_PROGRESS_EVERY_S"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(CACHE, "the feature store's folder, or off (default ~/.cache/fewclip/features; feature_store= wins)"),
    EnvVar(CACHE_VERIFY, "how the store checks image files before serving their features: stat (size and time, "
                         "default) or hash (their contents)"),
    EnvVar(DEBUG, "1: an error prints its Python trace as well (as --debug does)"),
    EnvVar(LOCK_TIMEOUT_S, "seconds after which a run's or store group's lock with no live holder is taken over "
                           "(default 600; sweep.lock_timeout_s wins)"),
    EnvVar(PROGRESS_EVERY_S, "seconds between plain progress lines when stderr is not a terminal (default 10)"),
)


def describe_environment() -> str:
    """One line per variable, for ``fewclip --help``."""
    width = max(len(v.name) for v in VARIABLES) + 2
    return "\n".join(f"  {v.name:<{width}}{v.help}" for v in VARIABLES)
