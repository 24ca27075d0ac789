"""Exports: a finished run as a classifier that needs only the frozen backbone.

``fewclip export RUN_DIR [-o PATH] [OPTION=VALUE ...]`` writes a run in its
adapter's own format, and ``fewclip predict`` / ``fewclip.load_prompts`` load
any export back as a ``Classifier``::

    fewclip export runs/coop -o prompts.safetensors
    fewclip predict prompts=prompts.safetensors cat.jpg dog.png top_k=3

    import fewclip
    clf = fewclip.load_prompts("prompts.safetensors")      # loads and checks the backbone
    clf.predict([Image.open("cat.jpg")], top_k=3)          # [[("tabby", 0.91), ...]]
    clf.with_classnames(["lynx", "ocelot"])                # where the format allows new names

The core knows no format. Each adapter registers its ``ExportFormat`` beside
it (``register_adapter(..., export=...)``; CoOp's prompt file in
``fewclip.adapters.coop_export``, LoRA's peft folder in
``fewclip.adapters.lora_export``). ``export_run`` reads the run (config,
split, templates, adapter tensors), checks that the backbone has the weights
the run was trained on, rebuilds the adapter and calls the format's ``write``
with the metadata every export carries:

* ``format`` (the format's name), ``format_version``, ``fewclip_version``;
* ``backbone``: ``name``, ``source``, ``weights_sha256`` of its weights file,
  ``state_sha256`` (a checksum of the loaded state dict, only where no weights
  file checksum exists, e.g. open_clip pretrained tags) and ``config``, the
  ``backbone`` section to load it again;
* ``geometry`` (``name``, ``params``), ``preprocess`` (``image_size``,
  ``mean``, ``std``, ``resize_mode``, ``interpolation``, ``fill_color``), ``tokenizer``, ``classnames``;
* ``run`` (``dir``, ``dataset``, ``shots``, ``seed``, ``top1``).

An export keeps this metadata as JSON under the ``"fewclip"`` metadata key of
a ``.safetensors`` file, or in ``fewclip.json`` inside an export folder.
``load_prompts`` reads it, finds the format by its name, checks the version,
loads the backbone it names (or takes the one given) and refuses other
weights, then calls the format's ``load``.

Probabilities: ``predict`` reports a softmax over the classifier's classes for
every geometry, the closed-set class posterior the methods are trained for.
For the ``sigmoid`` geometry (SigLIP) the logit bias is a constant that cancels
in the softmax; SigLIP's per-pair sigmoid match probabilities are
``torch.sigmoid(clf.logits(images))`` if you want them.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import OmegaConf
from PIL import Image, UnidentifiedImageError
from safetensors import safe_open

from fewclip.adapter.base import EXPORT_FORMATS
from fewclip.backbones.backbone import backbone_config_from_dict, load_backbone
from fewclip.backbones.geometry import make_geometry
from fewclip.data.base import to_rgb
from fewclip.features.feature_file import backbone_from_export
from fewclip.utils.checksums import state_sha256
from fewclip.utils.errors import InputError
from fewclip.version import __version__

log = logging.getLogger(__name__)

METADATA_KEY = "fewclip"  # the safetensors metadata key of a file export
META_FILE = "fewclip.json"  # the metadata of a folder export
# Keys every export's metadata has (and what each must be).
_REQUIRED = {"format": str, "format_version": int, "backbone": dict, "geometry": dict, "classnames": list,
             "preprocess": dict}


class ExportError(InputError):
    """A run that cannot be exported, or an export or image that cannot be used; the message says which."""


# ---------------------------------------------------------------------------
# backbone identity
# ---------------------------------------------------------------------------


def backbone_identity(backbone, cfg=None) -> dict[str, Any]:
    """What names a backbone in an export: name, source, checksum, and the config section to load it."""
    ident = {
        "name": backbone.name,
        "source": backbone.source,
        "weights_sha256": backbone.weights_sha256,
        "state_sha256": None if backbone.weights_sha256 else state_sha256(backbone.model),
        **getattr(backbone, "identity_extra", {}),  # a feature backbone: the file it comes from
    }
    if cfg is not None:
        ident["config"] = {"name": cfg.name, "pretrained": cfg.pretrained, "geometry": cfg.geometry,
                           "precision": cfg.precision}
        if cfg.local_attention.active:

            ident["config"]["local_attention"] = OmegaConf.to_container(OmegaConf.structured(cfg.local_attention))
    return ident


def check_backbone(meta: dict[str, Any], backbone, path: Union[str, Path]) -> None:
    """Refuse a backbone whose weights are not the ones the export was made from."""
    want = meta["backbone"]
    if want.get("weights_sha256"):
        have, kind = backbone.weights_sha256, "weights sha256"
        want_sum = want["weights_sha256"]
    else:
        have, kind = state_sha256(backbone.model), "state-dict sha256"
        want_sum = want.get("state_sha256")
    if not want_sum or have != want_sum:
        raise ExportError(
            f"export {path} was exported from another backbone: it names {want.get('name')!r} with {kind} "
            f"{str(want_sum)[:16]}..., but the loaded backbone {backbone.name!r} ({backbone.source}) has "
            f"{str(have)[:16]}.... What a run learned only works with the exact weights it was learned on."
        )
    g = meta["geometry"]
    if g["name"] != backbone.geometry.name:
        raise ExportError(f"export {path} uses the {g['name']!r} geometry but backbone {backbone.name!r} "
                          f"has {backbone.geometry.name!r}")


def backbone_metadata(bb, backbone_cfg=None) -> dict[str, Any]:
    """The metadata every export carries about its backbone: identity, geometry, preprocessing, tokenizer."""
    pre = getattr(bb, "preprocess_cfg", None)  # None: a feature backbone (features from a file, no images)
    return {
        "backbone": backbone_identity(bb, backbone_cfg),
        "geometry": {"name": bb.geometry.name, "params": bb.geometry.params()},
        "preprocess": {"image_size": bb.image_size, "mean": list(bb.mean), "std": list(bb.std),
                       **({k: v for k, v in pre.card_section().items() if k not in ("mean", "std")} if pre else {})},
        "tokenizer": bb.tokenizer_spec,
    }


def backbone_from_metadata(meta: dict[str, Any], path, device: str,
                           backbone_overrides: Optional[dict[str, Any]] = None):
    """Load the backbone an export names (its stored config section, with overrides)."""


    features = backbone_from_export(meta)  # an export of a run on a feature file
    if features is not None:
        return features
    stored = dict(meta["backbone"].get("config") or {"name": meta["backbone"]["name"]})
    stored.update(backbone_overrides or {})
    stored["device"] = device
    try:
        cfg = backbone_config_from_dict(stored)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: cannot make a backbone config from {stored}: {e}") from None
    return load_backbone(cfg)


# ---------------------------------------------------------------------------
# the metadata of an export
# ---------------------------------------------------------------------------


def export_metadata(adapter, fmt, *, backbone_cfg=None, run: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The metadata every export carries (module docstring), for ``adapter`` in format ``fmt``."""

    return {
        "format": fmt.name,
        "format_version": fmt.version,
        "fewclip_version": __version__,
        **backbone_metadata(adapter.backbone, backbone_cfg),
        "classnames": list(adapter.classnames),
        "run": dict(run or {}),
    }


def read_metadata(path: Union[str, Path]) -> dict[str, Any]:
    """The metadata of an export: a ``.safetensors`` file's ``"fewclip"`` entry, or a folder's ``fewclip.json``.
    Any problem is an ExportError naming it."""
    path = Path(path)
    if path.is_dir():
        if not (path / META_FILE).is_file():
            raise ExportError(f"{path} is a folder but not a fewclip export (it has no {META_FILE}): give a prompt "
                              f"file or export folder written by `fewclip export`")
        try:
            text = (path / META_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ExportError(f"cannot read {path / META_FILE}: {e}") from None
        where = f"{path / META_FILE}"
    else:

        if not path.is_file():
            raise ExportError(f"export not found: {path}")
        try:
            with safe_open(str(path), "pt") as f:
                raw = f.metadata() or {}
        except Exception as e:  # truncated or not safetensors at all
            raise ExportError(f"{path} is damaged or not a safetensors file ({e})") from None
        if METADATA_KEY not in raw:
            raise ExportError(f"{path} has no {METADATA_KEY!r} metadata: not a file written by fewclip export")
        text, where = raw[METADATA_KEY], f"{path}: its {METADATA_KEY!r} metadata"
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise ExportError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{where} must be a JSON object")
    return meta


def check_metadata(meta: dict[str, Any], path: Union[str, Path], fmt) -> None:
    """The keys every export has, and a version of ``fmt`` that this fewclip reads."""
    where = Path(path) / META_FILE if Path(path).is_dir() else path
    fix = "the export is damaged or was not written by `fewclip export`: export the run again"
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= fmt.version:
        newer = isinstance(version, int) and version > fmt.version
        raise ExportError(f"{where} has {fmt.name} format version {version!r}; this fewclip reads version "
                          f"{fmt.version}" + (" (written by a newer fewclip: upgrade)" if newer else f"; {fix}"))
    for key, typ in _REQUIRED.items():
        if not isinstance(meta.get(key), typ):
            raise ExportError(f"{where}: metadata key {key!r} is missing or not a {typ.__name__}; {fix}")
    for key, typ in (("name", str), ("params", dict)):
        if not isinstance(meta["geometry"].get(key), typ):
            raise ExportError(f"{where}: metadata geometry.{key} is missing or not a {typ.__name__}; {fix}")
    if not meta["backbone"].get("name") or not (meta["backbone"].get("weights_sha256")
                                                or meta["backbone"].get("state_sha256")):
        raise ExportError(f"{where}: metadata backbone needs a name and a weights checksum; {fix}")


def format_of(meta: dict[str, Any], path: Union[str, Path]):
    """The registered ``ExportFormat`` an export's metadata names."""

    name = meta.get("format")
    if name not in EXPORT_FORMATS:
        raise ExportError(f"{path} is not an export this fewclip reads (format {name!r}; known: "
                          f"{', '.join(sorted(EXPORT_FORMATS))})")
    return EXPORT_FORMATS[name]


# ---------------------------------------------------------------------------
# the classifier
# ---------------------------------------------------------------------------

ImageInput = Union["PIL.Image.Image", str, Path, torch.Tensor, Sequence[Any]]  # noqa: F821


def load_image(path: Union[str, Path]):
    """An RGB PIL image; an unreadable file is an ExportError naming it."""

    path = Path(path)
    if path.is_dir():
        raise ExportError(f"{path} is a folder: predict takes image files (for a folder's images, e.g. {path}/*.jpg)")
    if not path.is_file():
        raise ExportError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return to_rgb(im)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise ExportError(f"cannot read image {path}: {e}") from None


class Classifier:
    """Images -> class logits on a backbone: what ``load_prompts`` returns for every export format.

    A format's loader returns a subclass implementing ``logits_from_features`` (raw image-tower features
    [B, D] -> logits [B, C]) and, where its classes can change, ``with_classnames``. ``geometry`` is built
    from the export's stored parameters. Preprocessing, batching, probabilities and ``predict`` are shared.
    """

    def __init__(self, backbone, meta: dict[str, Any], path: Optional[Path] = None,
                 classnames: Optional[Sequence[str]] = None):

        self.backbone = backbone
        self.meta = meta
        self.path = path
        self.classnames: list[str] = list(classnames if classnames is not None else meta["classnames"])
        g = meta["geometry"]
        try:
            self.geometry = make_geometry(g["name"], **g["params"]).to(backbone.device)
        except (ValueError, TypeError) as e:
            raise ExportError(f"export {path}: bad geometry {g}: {e}") from None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.classnames)} classes, {self.backbone.name} [{self.geometry.name}], "
                f"{self.meta.get('format')})")

    # -- images -> logits --------------------------------------------------
    def pixels(self, images: ImageInput) -> torch.Tensor:
        """Preprocessed pixels [B, 3, H, W] from PIL images, image paths, or a pixel tensor (passed through)."""
        if isinstance(images, torch.Tensor):
            return images.unsqueeze(0) if images.dim() == 3 else images
        if not isinstance(images, (list, tuple)):
            images = [images]
        tf = self.backbone.preprocess()

        out = [tf(load_image(im) if isinstance(im, (str, Path)) else to_rgb(im)) for im in images]
        return torch.stack(out) if out else torch.empty(0, 3, self.backbone.image_size, self.backbone.image_size)

    def logits_from_features(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw image-tower features [B, D] -> logits [B, C]."""
        raise NotImplementedError

    @torch.no_grad()
    def logits(self, images: ImageInput, batch_size: int = 256) -> torch.Tensor:
        """Logits [B, C] for PIL images, image paths, or preprocessed pixels [B, 3, H, W]."""
        px = self.pixels(images)
        outs = [self.logits_from_features(self.backbone.encode_images(px[i : i + batch_size]))
                for i in range(0, len(px), batch_size)]
        return torch.cat(outs) if outs else torch.empty(0, len(self.classnames), device=self.backbone.device)

    def probabilities(self, images: ImageInput) -> torch.Tensor:
        """Softmax over the classes [B, C], for every geometry (see the module docstring)."""
        logits = self.logits(images)
        bad = ~torch.isfinite(logits).all(dim=-1)
        if bool(bad.any()):  # never a nan probability: the export (or what it was loaded with) is broken
            raise ExportError(f"export {self.path}: NaN or infinite logits for {int(bad.sum())} of {len(logits)} "
                              f"image(s); the export is damaged or was made from a diverged run: export a finished "
                              f"run again")
        return logits.softmax(-1)

    def predict(self, images: ImageInput, top_k: int = 5) -> list[list[tuple[str, float]]]:
        """The ``top_k`` (class name, probability) pairs of each image, most probable first."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        probs = self.probabilities(images).cpu()
        top = probs.topk(min(top_k, len(self.classnames)), dim=-1)
        return [[(self.classnames[int(i)], float(v)) for v, i in zip(vals, idx)]
                for vals, idx in zip(top.values, top.indices)]

    def with_classnames(self, classnames: Sequence[str]) -> Classifier:
        """A classifier for other class names, where the export allows it."""
        raise ExportError(f"a {self.meta.get('format')} export classifies its own classes only")


class PrototypeClassifier(Classifier):
    """One point per class in the geometry (``prototypes`` [C, D]), compared with the embedded image features."""

    def __init__(self, backbone, meta: dict[str, Any], prototypes: torch.Tensor, path: Optional[Path] = None,
                 classnames: Optional[Sequence[str]] = None):
        super().__init__(backbone, meta, path, classnames)
        self.prototypes = prototypes.to(backbone.device)  # C, D

    @torch.no_grad()
    def logits_from_features(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw image-tower features [B, D] -> logits [B, C]."""
        return self.geometry.image_logits(raw, self.prototypes)


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


def load_prompts(path: Union[str, Path], device: str = "auto", *, backbone=None,
                 backbone_overrides: Optional[dict[str, Any]] = None) -> Classifier:
    """Load what ``fewclip export`` wrote, in any registered format, with the backbone it names; refuse a
    backbone with other weights.

    ``backbone`` reuses an already loaded backbone (still checked, never changed);
    ``backbone_overrides`` changes fields of the stored backbone config, e.g.
    ``{"name": "path/to/card.yaml"}`` when the card has moved.
    """
    path = Path(path)
    meta = read_metadata(path)
    fmt = format_of(meta, path)
    check_metadata(meta, path, fmt)
    if backbone is None:
        backbone = backbone_from_metadata(meta, path, device, backbone_overrides)
    check_backbone(meta, backbone, path)
    return fmt.load(path, meta, backbone)
