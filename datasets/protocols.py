"""The generalisation protocols, kept importable here; they live in the core as ``fewclip.data.protocols``."""
from fewclip.data.protocols import *  # noqa: F401,F403
