"""The method contract (``Adapter``, the registry) and the export formats methods write.

``fewclip.adapter`` was one module until fewclip 0.2; its names still resolve here (from ``fewclip.adapter.base``) with a
``DeprecationWarning``, for one release.
"""


def __getattr__(name: str):
    import importlib  # on first use of an old name only
    import warnings

    module = importlib.import_module("fewclip.adapter.base")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fewclip.adapter.{name} moved to fewclip.adapter.base.{name}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(module, name)
