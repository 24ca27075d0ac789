"""fewclip: few-shot adaptation of frozen CLIP-family models of any embedding geometry.

The Python API (``fewclip.api``): ``train``, ``zeroshot``, ``sweep``, ``report``, ``load_run``, ``list_adapters``,
``list_datasets``, ``list_backbones``; ``load_prompts`` (an export as a classifier) and ``fit_features`` (a method
on features you already have). They are loaded on first use, so ``import fewclip`` stays light (no torch).
"""
from fewclip.version import __version__  # noqa: F401

_API = {"train", "zeroshot", "sweep", "report", "load_run", "list_adapters", "list_datasets", "list_backbones",
        "Run", "SweepResult"}
__all__ = sorted(_API | {"load_prompts", "fit_features", "__version__"})


def __getattr__(name: str):
    if name in _API:
        import fewclip.api  # on first use: `import fewclip` stays light (no torch)

        return getattr(fewclip.api, name)
    raise AttributeError(f"module 'fewclip' has no attribute {name!r}")


def load_prompts(path, device="auto", **kwargs):
    """Load what ``fewclip export`` wrote, in any method's format (e.g. a CoOp prompt file, a LoRA export
    folder or its merged file), into a classifier: see ``fewclip.adapter.exports.load_prompts``."""
    from fewclip.adapter.exports import load_prompts as _load_prompts  # on first use, as the API

    return _load_prompts(path, device=device, **kwargs)


def fit_features(method, train_x, train_y, classnames, text, geometry, **kwargs):
    """Fit a method on image features you already have and get back a classifier that scores new features and
    exports like a run: see ``fewclip.training.on_features.fit_features``."""
    from fewclip.training.on_features import fit_features as _fit_features  # on first use, as the API

    return _fit_features(method, train_x, train_y, classnames, text, geometry, **kwargs)
