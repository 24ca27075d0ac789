"""fewclip: few-shot adaptation of frozen CLIP-family models of any embedding geometry."""
from fewclip.version import __version__  # noqa: F401


def load_prompts(path, device="auto", **kwargs):
    """Load what ``fewclip export`` wrote, in any method's format (e.g. a CoOp prompt file, a LoRA export
    folder or its merged file), into a classifier: see ``fewclip.adapter.exports.load_prompts``."""
    from fewclip.adapter.exports import load_prompts as _load_prompts  # on first use: `import fewclip` stays light (no torch)

    return _load_prompts(path, device=device, **kwargs)


def fit_features(method, train_x, train_y, classnames, text, geometry, **kwargs):
    """Fit a method on image features you already have and get back a classifier that scores new features and
    exports like a run: see ``fewclip.training.on_features.fit_features``."""
    from fewclip.training.on_features import fit_features as _fit_features  # on first use, as load_prompts

    return _fit_features(method, train_x, train_y, classnames, text, geometry, **kwargs)
