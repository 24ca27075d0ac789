"""The adapter interface, kept importable here for methods written against ``fewclip.adapters.base``; it lives
in the core as ``fewclip.adapter.base`` (the core never imports this package: it finds methods through the registry)."""
from fewclip.adapter.base import *  # noqa: F401,F403
