"""The method contract (``Adapter``, the registry) and the export formats methods write.

``fewclip.adapter`` was one module before the layered layout; its names still resolve here (from ``fewclip.adapter.base``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.adapter.base")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.adapter.{name} moved to fewclip.adapter.base.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
