"""The generic adapter export, kept importable here; it lives in the core as ``fewclip.adapter.state_export``."""
from fewclip.adapter.state_export import *  # noqa: F401,F403
from fewclip.adapter.state_export import STATE  # noqa: F401
