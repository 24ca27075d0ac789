"""Datasets: the interface and registry, few-shot splits, protocols, split files.

``fewclip.data`` was one module before the layered layout; its names still resolve here (from ``fewclip.data.base``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.data.base")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.data.{name} moved to fewclip.data.base.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
