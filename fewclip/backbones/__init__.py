"""Frozen backbones: geometries, towers, tokenizers, preprocessing, checkpoint formats and imports.

``fewclip.backbones`` was one module before the layered layout; its names still resolve here (from ``fewclip.backbones.backbone``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.backbones.backbone")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.backbones.{name} moved to fewclip.backbones.backbone.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
