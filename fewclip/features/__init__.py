"""Image features: encoding with a backbone, the on-disk store, feature files.

``fewclip.features`` was one module before the layered layout; its names still resolve here (from ``fewclip.features.encode``) with a
``DeprecationWarning``, for one release.
"""
import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("fewclip.features.encode")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.features.{name} moved to fewclip.features.encode.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
