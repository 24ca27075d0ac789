"""Feature files: a classification task as image features you already have, readable as a dataset.

``data=features data.path=F.safetensors`` runs any method that trains on cached features (Tip-Adapter(-F),
CLIP-Adapter, TaskRes, LP++, CLAP, the probes) and zero-shot on the file's features, with the run's usual
few-shot split, validation, sweep, report and export. The file is the backbone too: its geometry and its class
text features make a ``fewclip.backbones.feature_backbone.FeatureBackbone``, so ``backbone=`` is not used.

The format (``fewclip.features.encode/1``), one safetensors file:

========================  ===================================================================================
tensor                    what
========================  ===================================================================================
``train.x``, ``train.y``  raw image-tower outputs [N, D] (float) and labels [N] (int) of the training pool
``val.x``, ``val.y``      the validation pool (optional: without it, runs have no validation images)
``test.x``, ``test.y``    the test set
``train.views``           optional [V, N, D]: V augmented views of the training images (view k of a run is
                          view k mod V); without it every view is the plain features (no augmentation)
``text``                  [C, T, D] raw text-tower outputs of each template filled with each class name
                          ([C, D]: one template); optional when the metadata names a ``backbone`` to build it
========================  ===================================================================================

and, under the safetensors metadata key ``"fewclip"``, a JSON object: ``format`` ("fewclip.features"),
``format_version`` (1), ``classnames`` (C names), ``templates`` (T strings with one ``{}``; default ``["{}"]``),
``geometry`` (``{"name": ..., "params": {...}}``, fewclip.backbones.geometry's names and constructor keywords; default the
named backbone's), and optionally ``dataset`` (a name for reports; default the file's stem), ``backbone`` (the
backbone config section that made the features, used to build ``text`` when the file has none), ``source``
(anything: where the features came from) and ``tensors_sha256`` (what ``write_feature_file`` adds: a sha256 of
each tensor, ``fewclip.utils.tensor_checks``; a file that has it is refused where a tensor's bytes changed).

Raw features are what the geometry embeds (``geometry.embed_image``): for the clip and sigmoid geometries any
vectors along the features' directions (unit vectors do), for the others the tower's output itself. ``fewclip
features`` writes such a file from any dataset and backbone (``fewclip.cli.features``).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fewclip.backbones.backbone import backbone_config_from_dict, load_backbone
from fewclip.backbones.feature_backbone import FeatureBackbone
from fewclip.backbones.geometry import make_geometry
from fewclip.data.base import SPLITS, DataConfig, Dataset, DatasetError, Item, build_dataset, check_classnames
from fewclip.features.encode import class_text_features
from fewclip.utils.io import atomic_write
from fewclip.utils.tensor_checks import INT, check_digests, check_tensor, tensor_digests

FORMAT = "fewclip.features"
FORMAT_VERSION = 1
META_KEY = "fewclip"


@dataclass
class FeatureFile:
    """A feature file's content: per split ``(x [N, D], y [N])``, optional training views, the class text
    features and the metadata."""

    splits: dict[str, tuple]
    classnames: list[str]
    templates: list[str]
    text: Optional[Tensor]  # [C, T, D] or None (built from meta["backbone"])
    geometry: Optional[dict[str, Any]]
    views: Optional[Tensor] = None  # [V, N, D]
    meta: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_feature_file(path, *, train, test, classnames: Sequence[str], text: Optional[Tensor],
                       geometry: Optional[dict[str, Any]], val=None, templates: Sequence[str] = ("{}",),
                       views: Optional[Tensor] = None, **meta: Any) -> Path:
    """Write a feature file (module docstring). ``train``/``val``/``test``: ``(x [N, D], y [N])`` pairs;
    ``geometry``: ``{"name": ..., "params": {...}}``; ``meta``: ``dataset``, ``backbone``, ``source``."""
    tensors: dict[str, Tensor] = {}
    for split, pair in (("train", train), ("val", val), ("test", test)):
        if pair is None:
            continue
        x, y = pair
        tensors[f"{split}.x"] = x.detach().float().cpu().contiguous()
        tensors[f"{split}.y"] = y.detach().long().cpu().contiguous()
    if views is not None:
        tensors["train.views"] = views.detach().float().cpu().contiguous()
    if text is not None:
        tensors["text"] = text.detach().float().cpu().contiguous()
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "classnames": list(classnames),
              "templates": list(templates), "geometry": geometry, **meta}
    _checked(tensors, header, str(path))  # what is written reads back
    header["tensors_sha256"] = tensor_digests(tensors)
    path = Path(path)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={META_KEY: json.dumps(header)}))
    return path


def read_feature_file(path) -> FeatureFile:
    """Read and check a feature file; any problem is a ``DatasetError`` naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"data.path={str(path)!r} is not a file; give a feature file (`fewclip features` writes "
                           f"one from a dataset and a backbone)")
    try:
        with safe_open(str(path), "pt") as f:
            raw_meta = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a file that is not one of its own
        raise DatasetError(f"cannot read feature file {path}: {e} (it must be a safetensors file)") from None
    if raw_meta is None:
        raise DatasetError(f"{path} has no {META_KEY!r} metadata: it is not a fewclip feature file (README: "
                           f"'Methods on your own features' gives the format)")
    try:
        header = json.loads(raw_meta)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: its {META_KEY!r} metadata is not JSON ({e})") from None
    ff = _checked(tensors, header, str(path))
    check_digests(tensors, header.get("tensors_sha256"), str(path), DatasetError,
                  "; write the file again (`fewclip features`)")
    return ff


def _checked(tensors: dict[str, Tensor], header: dict[str, Any], where: str) -> FeatureFile:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DatasetError(f"{where}: metadata format must be {FORMAT!r}, got {header.get('format')!r}")
    if int(header.get("format_version", 0)) > FORMAT_VERSION:
        raise DatasetError(f"{where}: format_version {header['format_version']} is newer than this fewclip reads "
                           f"({FORMAT_VERSION}); upgrade fewclip")
    classnames = check_classnames(header.get("classnames") or [], f"feature file {where}")
    templates = list(header.get("templates") or ["{}"])
    bad = [t for t in templates if not isinstance(t, str) or t.count("{}") != 1]
    if bad:
        raise DatasetError(f"{where}: each template needs exactly one '{{}}' for the class name; bad: {bad}")
    splits, dim = {}, None
    for split in SPLITS:
        x, y = tensors.get(f"{split}.x"), tensors.get(f"{split}.y")
        if x is None and y is None:
            continue
        if x is None or y is None:
            raise DatasetError(f"{where}: {split}.x and {split}.y go together; the file has only one of them")
        if x.dim() != 2 or y.shape != (x.shape[0],):
            raise DatasetError(f"{where}: {split}.x must be [N, D] and {split}.y [N], got {tuple(x.shape)} and "
                               f"{tuple(y.shape)}")
        check_tensor(x, f"{split}.x", where, DatasetError, " (it must hold finite floating-point features)")
        check_tensor(y, f"{split}.y", where, DatasetError, f" (it must hold integer labels in [0, {len(classnames)}))",
                     kind=INT)
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= len(classnames)):
            raise DatasetError(f"{where}: {split}.y must hold integer labels in [0, {len(classnames)})")
        if dim is not None and x.shape[1] != dim:
            raise DatasetError(f"{where}: {split}.x has width {x.shape[1]}, other splits {dim}")
        dim = x.shape[1]
        splits[split] = (x.float(), y.long())
    for need in ("train", "test"):
        if need not in splits:
            raise DatasetError(f"{where}: no {need}.x / {need}.y; a feature file needs a training pool and a test "
                               f"set")
    views = tensors.get("train.views")
    if views is not None:
        check_tensor(views, "train.views", where, DatasetError, " (V augmented views of the training features: "
                     "finite floating-point values)", shape=("V", len(splits["train"][1]), dim))
    text = tensors.get("text")
    if text is not None:
        text = text[:, None, :] if isinstance(text, Tensor) and text.dim() == 2 else text
        check_tensor(text, "text", where, DatasetError, " (the class text features: finite floating-point values, "
                     "[classes, templates, width]; [classes, width] for one template)",
                     shape=(len(classnames), len(templates), dim))
    elif not header.get("backbone"):
        raise DatasetError(f"{where}: no text features: add a 'text' tensor [C, T, D], or name the backbone that "
                           f"made the features in the metadata ('backbone': {{'name': ...}}) to build them")
    geometry = header.get("geometry")
    if geometry is not None and not (isinstance(geometry, dict) and isinstance(geometry.get("name"), str)):
        raise DatasetError(f"{where}: geometry must be {{'name': ..., 'params': {{...}}}}, got {geometry!r}")
    if geometry is None and not header.get("backbone"):
        raise DatasetError(f"{where}: no geometry: add {{'geometry': {{'name': 'clip', 'params': {{'logit_scale': "
                           f"100.0}}}}}} (fewclip.backbones.geometry's names) to the metadata")
    return FeatureFile(splits, classnames, templates, text, geometry, views.float() if views is not None else None,
                       header)


def feature_backbone(ff: FeatureFile, *, name: str, sha256: Optional[str] = None) -> FeatureBackbone:
    """The file's geometry and text table as a backbone; where the file has no text features (or no geometry),
    the backbone its metadata names builds them (its towers run once, here, on the class prompts)."""
    text, geometry = ff.text, None
    if ff.geometry is not None:
        try:
            geometry = make_geometry(ff.geometry["name"], **(ff.geometry.get("params") or {}))
        except (TypeError, ValueError) as e:
            raise DatasetError(f"feature file {name}: geometry {ff.geometry}: {e}") from None
    if text is None or geometry is None:
        bb = load_backbone(backbone_config_from_dict(ff.meta["backbone"]))
        text = class_text_features(bb, ff.classnames, ff.templates).cpu() if text is None else text
        geometry = geometry or bb.geometry.cpu()
    return FeatureBackbone(geometry, ff.classnames, ff.templates, text, name=name, weights_sha256=sha256,
                           source=str(ff.meta.get("source", "")), feature_dim=ff.splits["test"][0].shape[1],
                           info={k: ff.meta[k] for k in ("dataset", "backbone") if k in ff.meta})


class FeatureDataset(Dataset):
    """A feature file as a dataset: item ``"<split>/<i>"`` is row i of that split; its features are the image
    tower's output, so there are no images to load. ``feature_backbone`` is the run's backbone."""

    def load_image(self, item: Item):
        raise DatasetError(f"dataset {self.name!r} is a feature file: it holds image features, not images, so "
                           f"nothing can encode its images (train.augment_views=0 encodes fresh views at every "
                           f"step: keep the cached views, the default)")

    def stored(self, items: Sequence[Item], view) -> Tensor:
        """Rows [len(items), D] of these items: view ``view.index`` mod V of the training images where the file
        holds views, else the plain features."""
        out = []
        for it in items:
            split, _, i = it.id.partition("/")
            if view is not None and split == "train" and self.views is not None:
                out.append(self.views[view.index % len(self.views), int(i)])
            else:
                out.append(self.arrays[split][int(i)])
        return torch.stack(out) if out else torch.empty(0, self.feature_backbone.feature_dim)


def dataset_backbone(dataset) -> Optional[FeatureBackbone]:
    """The backbone a dataset brings (a feature file's), or None."""
    while dataset is not None and not isinstance(dataset, FeatureDataset):
        dataset = getattr(dataset, "parent", None)
    return None if dataset is None else dataset.feature_backbone


def feature_dataset_name(cfg: DataConfig) -> str:
    """The name of the dataset a feature file holds (its metadata's ``dataset``, else the file's stem), read from
    the header only; ``features`` where ``data.path`` is missing or unreadable (the builder then says why)."""
    if not cfg.path or not Path(cfg.path).is_file():
        return cfg.name
    try:
        with safe_open(str(cfg.path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY) or "{}")
    except Exception:  # an unreadable file: build_feature_dataset reports it
        return cfg.name
    return str(meta.get("dataset") or Path(cfg.path).stem)


def build_feature_dataset(cfg: DataConfig) -> FeatureDataset:
    if not cfg.path:
        raise DatasetError("data=features needs data.path=FILE.safetensors (a feature file: `fewclip features` "
                           "writes one; README 'Methods on your own features' gives the format)")
    path = Path(cfg.path)
    ff = read_feature_file(path)
    name = str(ff.meta.get("dataset") or path.stem)
    splits = {s: [Item(f"{s}/{i}", int(label)) for i, label in enumerate(y.tolist())] for s, (x, y) in ff.splits.items()}
    splits.setdefault("val", [])
    ds = FeatureDataset(name=name, classnames=ff.classnames, templates=ff.templates, splits=splits, root=None)
    ds.arrays = {s: x for s, (x, _) in ff.splits.items()}
    ds.views = ff.views
    ds.feature_backbone = feature_backbone(ff, name=f"features:{path.name}", sha256=_sha256(path))
    ds.feature_backbone.feature_file = str(path.resolve())
    return ds


# ---------------------------------------------------------------------------
# how runs, sweeps and exports take the backbone a feature file brings
# ---------------------------------------------------------------------------


def export_backbone(run_cfg) -> Optional[FeatureBackbone]:
    """The feature backbone of a run made on a feature file (its ``data.path``), or None."""
    if run_cfg.data.name != "features":
        return None
    return dataset_backbone(build_dataset(run_cfg.data))


def backbone_from_export(meta: dict[str, Any]) -> Optional[FeatureBackbone]:
    """The feature backbone an export of a feature-file run names (``backbone.feature_file``), or None."""
    bb = meta.get("backbone") or {}
    path = bb.get("feature_file")
    if not path:
        return None
    return dataset_backbone(build_dataset(DataConfig(name="features", path=path)))
