"""The dataset interface, kept importable here for readers written against ``fewclip.datasets.base``; it lives in
the core as ``fewclip.data.base``."""
from fewclip.data.base import *  # noqa: F401,F403
