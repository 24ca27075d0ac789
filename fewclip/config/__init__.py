"""Configuration: the sections (torch-free dataclasses), their help, presets, composing a run's tree.

``fewclip.config`` was one module before the layered layout; its names still resolve here (from ``fewclip.config.compose``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.config.compose")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.config.{name} moved to fewclip.config.compose.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
