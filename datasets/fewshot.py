"""Few-shot splits, kept importable here; they live in the core as ``fewclip.data.splits``."""
from fewclip.data.splits import *  # noqa: F401,F403
