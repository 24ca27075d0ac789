"""The ``fewclip`` command line.

``fewclip.cli`` was one module before the layered layout; its names still resolve here (from ``fewclip.cli.main``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.cli.main")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.cli.{name} moved to fewclip.cli.main.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
