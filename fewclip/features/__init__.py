"""Image features: encoding with a backbone, the on-disk store, feature files.

``fewclip.features`` was one module until fewclip 0.2; its names still resolve here (from ``fewclip.features.encode``) with a
``DeprecationWarning``, for one release.
"""


def __getattr__(name: str):
    import importlib  # on first use of an old name only
    import warnings

    module = importlib.import_module("fewclip.features.encode")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.features.{name} moved to fewclip.features.encode.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
