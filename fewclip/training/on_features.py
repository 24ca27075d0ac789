"""Methods on your own features: fit a method on tensors, and the hooks that let runs use a feature file.

In Python::

    clf = fewclip.fit_features("tip_adapter_f", train_x, train_y, classnames, text, "clip", val=(val_x, val_y))
    clf.logits(test_x); clf.predict(test_x); clf.export("tipf.safetensors")

``fit_features`` builds a ``fewclip.backbones.feature_backbone.FeatureBackbone`` (the geometry and the class text
features), writes nothing, and trains the method exactly as a run does: the same adapter, config defaults,
``train`` section and engine (``fewclip.training.engine.fit_adapter``), on a few-shot split that is every training row
given. What comes back scores new features and exports in the method's own format.

On the command line a feature file is a dataset (``data=features data.path=F.safetensors``:
``fewclip.features.feature_file``); :func:`backbone_of` is how a run, a sweep and an export take the backbone
such a dataset brings instead of loading ``backbone=``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from fewclip.adapter.base import ADAPTERS, AdapterConfig, AdapterError, adapter_info, build_adapter
from fewclip.adapter.exports import ExportError, backbone_metadata
from fewclip.backbones.feature_backbone import FeatureBackbone, TowerMissing, content_sha256
from fewclip.backbones.geometry import Geometry, make_geometry
from fewclip.data.base import Item
from fewclip.data.splits import FewShotSplit
from fewclip.features.feature_file import (  # noqa: F401
    FeatureDataset,
    backbone_from_export,
    dataset_backbone,
    export_backbone,
    feature_backbone,
    read_feature_file,
)
from fewclip.training.engine import RunFeatures, TrainConfig, fit_adapter
from fewclip.version import __version__

Pair = tuple[Tensor, Tensor]


# ---------------------------------------------------------------------------
# the Python API
# ---------------------------------------------------------------------------


def _geometry(geometry: Union[Geometry, str, dict[str, Any]]) -> Geometry:
    if isinstance(geometry, Geometry):
        return geometry
    if isinstance(geometry, str):
        return make_geometry(geometry)
    return make_geometry(geometry["name"], **(geometry.get("params") or {}))


class FeatureClassifier:
    """A method fitted on features: ``logits(x)`` / ``probs(x)`` / ``predict(x)`` on raw image features [B, D],
    ``export(path)`` in the method's export format (loadable with ``fewclip.load_prompts(path,
    backbone=clf.backbone)``)."""

    def __init__(self, adapter, backbone: FeatureBackbone, info: dict[str, Any]):
        self.adapter = adapter.eval()
        self.backbone = backbone
        self.info = info
        self.classnames = list(adapter.classnames)

    def __repr__(self) -> str:
        return f"FeatureClassifier({self.adapter.name}, {len(self.classnames)} classes, [{self.backbone.geometry.name}])"

    @torch.no_grad()
    def logits(self, x: Tensor, batch_size: int = 4096) -> Tensor:
        outs = [self.adapter(x[i:i + batch_size].float()) for i in range(0, len(x), batch_size)]
        return torch.cat(outs) if outs else torch.empty(0, len(self.classnames))

    def probs(self, x: Tensor) -> Tensor:
        return torch.softmax(self.logits(x), dim=-1)

    def predict(self, x: Tensor) -> list[str]:
        return [self.classnames[i] for i in self.logits(x).argmax(-1).tolist()]

    def export(self, path, **options) -> dict[str, Any]:
        """Write the method's export (``fewclip export``'s format for it); returns the metadata written."""
        fmt = adapter_info(self.adapter.name).export
        if fmt is None:
            raise ExportError(f"method {self.adapter.name!r} has no export format")
        meta = {"format": fmt.name, "format_version": fmt.version, "fewclip_version": __version__,
                **backbone_metadata(self.backbone), "classnames": list(self.classnames),
                "run": {"features": True, **{k: v for k, v in self.info.items() if k in ("shots", "seed")}}}
        return fmt.write(self.adapter, path, meta, **options)


def fit_features(method: str, train_x: Tensor, train_y: Tensor, classnames: Sequence[str], text: Tensor,
                 geometry: Union[Geometry, str, dict[str, Any]], *, val: Optional[Pair] = None,
                 templates: Sequence[str] = ("{}",), view_features: Optional[Tensor] = None, seed: int = 1,
                 train: Optional[dict[str, Any]] = None, **options: Any) -> FeatureClassifier:
    """Fit ``method`` (a registered name) on raw image features ``train_x`` [N, D] with labels ``train_y`` [N];
    ``text`` [C, D] or [C, T, D] are the raw text features of ``templates`` filled with ``classnames`` (for the
    clip geometry, the class prototypes themselves do); ``geometry`` a ``Geometry``, a name or ``{"name",
    "params"}``; ``val`` the validation pair the method selects on; ``view_features`` [V, N, D] augmented views of
    the training images (a feature file's ``train.views``; without them, the plain features); ``train``
    overrides of the ``train`` section; ``options`` the method's config fields, every one of them by its own name
    (``alpha_grad="accumulated"``, ``views=4``: how many views GDA or Tip-Adapter uses). The run's seed draws
    anything random. (``views=`` given a tensor is read as ``view_features``, as it was spelled before.)"""
    info = adapter_info(method)
    if isinstance(options.get("views"), Tensor):
        if view_features is not None:
            raise ValueError("fit_features: the augmented views are given twice (view_features= and a tensor as "
                             "views=); pass them as view_features= and the method's view count as views=N")
        view_features = options.pop("views")
    views = view_features
    fields = sorted(f.name for f in dataclasses.fields(info.config_cls))
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"fit_features: method {method!r} has no option {', '.join(map(repr, unknown))}; its "
                         f"options are {', '.join(fields) or 'none'}")
    cfg = info.config_cls(**options)
    names = list(classnames)
    text = text[:, None, :] if text.dim() == 2 else text
    geometry = _geometry(geometry)
    backbone = FeatureBackbone(geometry, names, list(templates), text.float(), name="features:tensors",
                               feature_dim=train_x.shape[1], weights_sha256=content_sha256(text, geometry))
    check_runs_on_features(cfg, backbone)
    splits = {"train": [Item(f"train/{i}", int(y)) for i, y in enumerate(train_y.tolist())],
              "val": [Item(f"val/{i}", int(y)) for i, y in enumerate(val[1].tolist())] if val is not None else [],
              "test": []}
    dataset = FeatureDataset(name="features", classnames=names, templates=list(templates), splits=splits)
    dataset.arrays = {"train": train_x.float(), "val": val[0].float() if val is not None else train_x[:0].float()}
    dataset.views = views.float() if views is not None else None
    dataset.feature_backbone = backbone
    shots = max(int((train_y == c).sum()) for c in range(len(names))) if len(train_y) else 0
    split = FewShotSplit(shots=shots, seed=seed, train=splits["train"], val=splits["val"], dataset="features",
                         classnames=names)
    train_cfg = TrainConfig(**{**info.adapter_cls.train_defaults, **(train or {})})
    generator = torch.Generator().manual_seed(seed)
    adapter = build_adapter(cfg, backbone, names, list(templates), generator=generator)
    run = RunFeatures(adapter, dataset, split, train_cfg, seed=seed)
    fitted = fit_adapter(adapter, run, train_cfg, shots=shots, generator=generator)
    return FeatureClassifier(adapter, backbone, {"shots": shots, "seed": seed, **fitted})


def read_features(path) -> dict[str, Any]:
    """A feature file's content as tensors and names (``train``, ``val``, ``test`` pairs; ``classnames``,
    ``templates``, ``text``, ``geometry``), e.g. to pass to :func:`fit_features`."""
    ff = read_feature_file(path)
    bb = feature_backbone(ff, name=f"features:{Path(path).name}")
    return {**{s: ff.splits.get(s) for s in ("train", "val", "test")}, "classnames": ff.classnames,
            "templates": ff.templates, "text": bb.text, "geometry": bb.geometry, "views": ff.views}


# ---------------------------------------------------------------------------
# how runs, sweeps and exports take the backbone a feature file brings
# ---------------------------------------------------------------------------


def check_runs_on_features(cfg: AdapterConfig, backbone: FeatureBackbone) -> None:
    """Build the method once on ``backbone``; a method that needs a tower is an ``AdapterError`` of one line
    naming the method, what it needs and the methods that run on features."""
    try:
        build_adapter(cfg, backbone, backbone.classnames, backbone.templates[:1])
    except TowerMissing as e:
        raise AdapterError(f"method {cfg.name!r} cannot run on image features alone: it needs {e}. Methods that "
                           f"run on features: {', '.join(feature_methods(backbone))}") from None


def feature_methods(backbone: FeatureBackbone) -> list[str]:
    """The registered methods that build on a feature backbone (with their default config)."""
    ok = []
    for name, info in sorted(ADAPTERS.items()):
        try:
            build_adapter(info.config_cls(), backbone, backbone.classnames, backbone.templates[:1])
        except Exception:  # a tower it needs (TowerMissing), or anything else: not listed
            continue
        ok.append(name)
    return ok


def backbone_of(dataset, cfg, load):
    """A run's backbone: the one its dataset brings (a feature file), checked against the run's method, else
    ``load(cfg.backbone)``."""
    own = dataset_backbone(dataset)
    if own is None:
        return load(cfg.backbone)
    adapter = getattr(cfg, "adapter", None)
    if adapter is not None:
        check_runs_on_features(adapter, own)
    return own
