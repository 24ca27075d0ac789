"""Image features and class prototypes from a frozen backbone.

Images become pixels through the backbone's own preprocessing or through an
augmented *view*: RandomResizedCrop (+ horizontal flip where the dataset
allows it) drawn from a ``torch.Generator`` seeded by (run seed, view index,
image id), so view k of an image is the same pixels whoever asks for it and in
whatever order (and never touches torch's global RNG). ``FeatureCache`` keeps
the frozen tower's output per request (an ordered list of images, as one view),
for the runs of a sweep to share, in memory and in the on-disk feature store
(``fewclip.features.store``) that worker processes and later sweeps share.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from fewclip.backbones.backbone import Backbone
from fewclip.data.class_names import class_keys
from fewclip.data.image_fingerprint import fingerprint
from fewclip.data.splits import derive_seed
from fewclip.features.address import address
from fewclip.utils.errors import os_error_message
from fewclip.utils.heartbeat import step
from fewclip.utils.progress import progress

log = logging.getLogger(__name__)



def held_features(dataset, items, view) -> Optional[torch.Tensor]:
    """The features of ``items`` where ``dataset`` holds features instead of images (a feature file,
    ``fewclip.features.feature_file``; or a protocol's class subset of one, through its ``parent``): its
    ``stored(items, view)``; None for a dataset of images."""
    while dataset is not None and not hasattr(dataset, "stored"):
        dataset = getattr(dataset, "parent", None)
    return None if dataset is None else dataset.stored(items, view)


# Encodings of at least this many images say so in the log (smaller ones take well under a second).
LOG_ENCODING_FROM = 256


class Features(NamedTuple):
    """Raw image-tower outputs and labels of some images (unpacks as ``x, y``)."""

    x: torch.Tensor  # [N, D] float32, CPU
    y: torch.Tensor  # [N] long

    @staticmethod
    def empty(dim: int) -> Features:
        return Features(torch.empty(0, dim), torch.empty(0, dtype=torch.long))


# ---------------------------------------------------------------------------
# augmented views
# ---------------------------------------------------------------------------


def crop_box(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
             generator: torch.Generator) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, h, w) for an image of ``height`` x ``width``, drawn from ``generator``.

    torchvision's ``RandomResizedCrop.get_params`` with the same draws in the same order (ten tries of an
    area fraction in ``scale`` and a log-uniform aspect ratio in ``ratio``, then a central crop), but from
    a generator instead of torch's global RNG."""
    area = height * width
    lo, hi = (float(v) for v in torch.log(torch.tensor(ratio)))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(lo, hi, generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = float(width) / float(height)  # fall back to a central crop
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@dataclass(frozen=True)
class Augment:
    """CoOp's training augmentation from a generator: RandomResizedCrop to the backbone's size (bicubic, area
    fraction in [scale_min, 1], aspect ratio in [3/4, 4/3]), a horizontal flip with probability 1/2 where
    ``hflip``, then the backbone's normalisation."""

    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale_min: float = 0.08
    hflip: bool = True

    @classmethod
    def for_run(cls, backbone: Backbone, dataset, scale_min: Optional[float] = None) -> Augment:
        """The augmentation of ``dataset`` on ``backbone``; ``scale_min`` None = the dataset's recommendation."""
        scale_min = scale_min if scale_min is not None else getattr(dataset, "min_crop_scale", 0.08)
        return cls(int(backbone.image_size), tuple(backbone.mean), tuple(backbone.std), float(scale_min),
                   bool(getattr(dataset, "hflip_ok", True)))

    def __call__(self, image, generator: torch.Generator) -> torch.Tensor:  # PIL image -> [3, size, size]
        top, left, h, w = crop_box(image.height, image.width, (self.scale_min, 1.0), (3 / 4, 4 / 3), generator)
        image = TF.resized_crop(image, top, left, h, w, [self.size, self.size],
                                interpolation=InterpolationMode.BICUBIC, antialias=True)
        if self.hflip and torch.rand(1, generator=generator).item() < 0.5:
            image = TF.hflip(image)
        return TF.normalize(TF.to_tensor(image.convert("RGB")), list(self.mean), list(self.std))


@dataclass(frozen=True)
class View:
    """View ``index`` of the training images of run ``seed``: image ``item`` gets the crop and flip drawn from
    a generator seeded by (seed, index, item id)."""

    augment: Augment
    seed: int
    index: int

    def generator(self, item) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, f"view/{self.index}/{item.id}"))

    def __call__(self, image, item) -> torch.Tensor:
        return self.augment(image, self.generator(item))


class ImageItems(TorchDataset):
    """Items of a fewclip dataset as (pixels, label) pairs: through ``transform``, or as the augmented ``view``."""

    def __init__(self, dataset, items: Sequence, transform: Optional[Callable] = None, view: Optional[View] = None):
        if (transform is None) == (view is None):
            raise ValueError("ImageItems takes a transform or a view, not both or neither")
        self.dataset = dataset
        self.items = list(items)
        self.transform = transform
        self.view = view

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        item = self.items[i]
        image = self.dataset.load_image(item)
        return (self.view(image, item) if self.view is not None else self.transform(image)), item.label


@torch.no_grad()
def extract_features(
    backbone: Backbone,
    dataset,
    items: Sequence,
    *,
    transform: Optional[Callable] = None,
    view: Optional[View] = None,
    batch_size: int = 256,
    workers: int = 0,
    desc: str = "features",
    encode: Optional[Callable] = None,
) -> Features:
    """Raw image-tower outputs [N, D] (float32, on CPU) and labels [N] for ``items``: preprocessed by
    ``transform`` (default: the backbone's), or as the augmented ``view``. ``encode`` replaces
    ``backbone.encode_images`` (an adapter's adapted image tower)."""
    encode = encode or backbone.encode_images
    if view is None:
        transform = transform or backbone.preprocess()
    # A generator of its own: the loader draws a base seed for its workers, and must not take it from the
    # global RNG (the images are fixed by the transform or the view's own generators anyway).
    loader = DataLoader(ImageItems(dataset, items, transform, view), batch_size=batch_size, shuffle=False,
                        num_workers=workers, generator=torch.Generator())
    feats: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    # Announced from LOG_ENCODING_FROM images; a smaller encoding is named by the heartbeat only if it runs long
    # (one batch of a large tower on a busy CPU can take a minute).
    with step(f"{desc}: encoding {len(items)} images with {backbone.name}", announce=len(items) >= LOG_ENCODING_FROM,
              logger=log):
        for pixels, y in progress(loader, desc=desc, unit="batch", leave=False):
            feats.append(encode(pixels).float().cpu())
            labels.append(y)
    if not feats:
        return Features(torch.empty(0), torch.empty(0, dtype=torch.long))
    return Features(torch.cat(feats), torch.cat(labels))


class Lookup(NamedTuple):
    """What ``FeatureCache.features`` gives: the features, how many of the images were encoded by this call,
    and how many came from the on-disk feature store (encoded by another process or an earlier sweep)."""

    features: Features
    encoded: int
    from_store: int


class FeatureCache:
    """Raw frozen-tower features of the runs of a sweep (or a worker's runs), per *request*: an ordered list of
    images of one dataset, as the backbone's own preprocessing (``view=None``) or as an augmented ``View``.

    A request is encoded as a whole, in batches of ``batch_size`` in its order, and kept: in memory, and in
    the on-disk ``store`` (``fewclip.features.store.FeatureStore``) when one is given, where other worker processes and
    later sweeps find it. So a request's features are the same bits whoever encoded it and whatever ran
    before (an image's features change in the last bits with the batch it is encoded in). The methods of a
    sweep that share a few-shot split ask for the same requests, and every run for the same test images.
    The cache holds a reference to each dataset it has features of, so a key is never reused by another
    dataset object.
    """

    def __init__(self, store=None):
        self.store = store
        self._entries: dict[tuple, tuple[object, Features, bool]] = {}  # key -> (dataset, features, from store)

    def features(self, backbone: Backbone, dataset, items: Sequence, *, view: Optional[View] = None,
                 batch_size: int = 256, workers: int = 0, desc: str = "features") -> Lookup:
        """Features of ``items`` (in their order): from memory, from the store, or encoded now."""
        ids = tuple(it.id for it in items)
        labels = torch.tensor([it.label for it in items], dtype=torch.long)
        if not items:
            return Lookup(Features(torch.empty(0), labels), 0, 0)
        stored = held_features(dataset, items, view)
        if stored is not None:  # a feature file (data=features): its rows are the image tower's output
            return Lookup(Features(stored, labels), 0, 0)
        key = (backbone.name, backbone.weights_sha256, backbone.variant, dataset.name, id(dataset), view,
               int(batch_size), ids)
        if key in self._entries:
            _, feats, stored = self._entries[key]
            return Lookup(feats, 0, len(items) if stored else 0)
        source = getattr(backbone, "stored_variant", lambda: None)()
        if source is not None:  # a tower with a projection: the features before it are kept, these derived
            got = self.features(source, dataset, items, view=view, batch_size=batch_size, workers=workers, desc=desc)
            feats = Features(backbone.project_features(got.features.x, batch_size), labels)
            self._entries[key] = (dataset, feats, got.from_store > 0)
            return Lookup(feats, got.encoded, got.from_store)
        group = self._group(backbone, dataset, view, batch_size)
        x = self._read(group, ids, dataset, items) if group is not None else None
        stored = x is not None
        if x is None and group is not None:
            x, stored = self._encode_once(group, backbone, dataset, items, view, batch_size, workers, desc)
        elif x is None:
            x = self._encode(backbone, dataset, items, view, batch_size, workers, desc)
        feats = Features(x, labels)
        self._entries[key] = (dataset, feats, stored)
        return Lookup(feats, 0 if stored else len(items), len(items) if stored else 0)

    # -- the on-disk store -------------------------------------------------
    def _group(self, backbone, dataset, view, batch_size):
        if self.store is None:
            return None
        return self.store.group(address(backbone, dataset, view, batch_size))

    def _read(self, group, ids, dataset, items):
        try:
            return group.read(ids, dataset, items, verify=self.store.verify)
        except OSError as e:
            self._store_failed(e)
            return None

    def _encode_once(self, group, backbone, dataset, items, view, batch_size, workers, desc):
        """Encode a request under its store lock, unless another process stored it meanwhile; stored with the
        fingerprint its images had before they were encoded (``fewclip.data.image_fingerprint``)."""
        ids = [it.id for it in items]
        try:
            lock = group.acquire(ids)
        except OSError as e:  # no lock can be made there: no store
            self._store_failed(e)
            return self._encode(backbone, dataset, items, view, batch_size, workers, desc), False
        try:
            x = self._read(group, ids, dataset, items)
            if x is not None:
                return x, True
            try:
                fp = fingerprint(dataset, items)
            except OSError:  # a missing or unreadable image: the encoder names it
                fp = None
            x = self._encode(backbone, dataset, items, view, batch_size, workers, desc)
            if fp is not None and self.store is not None:
                try:
                    group.write(ids, x, fp)
                except OSError as e:
                    self._store_failed(e)
            return x, False
        finally:
            lock.release()

    def _store_failed(self, e: OSError) -> None:
        log.warning("feature store at %s cannot be used (%s); features are kept in memory only", self.store.root,
                    os_error_message(e))
        self.store = None

    @staticmethod
    def _encode(backbone, dataset, items, view, batch_size, workers, desc) -> torch.Tensor:
        # In the backbone's own precision, whatever autocast the caller runs under: the store keys features by
        # that precision, so bf16 and fp32 features never share an address.
        with torch.autocast(backbone.device.type, enabled=False):
            x, _ = extract_features(backbone, dataset, items, view=view, batch_size=batch_size, workers=workers,
                                    desc=desc)
        return x


@torch.no_grad()
def class_text_features(backbone: Backbone, classnames: Sequence[str], templates: Sequence[str]) -> torch.Tensor:
    """Raw text-tower outputs [C, T, D] of every template filled with every class name."""
    if not templates:
        raise ValueError("at least one prompt template is needed")
    bad = [t for t in templates if t.count("{}") != 1]
    if bad:
        raise ValueError(f"each prompt template needs exactly one '{{}}' for the class name; bad: {bad}")
    held = getattr(backbone, "stored_class_text", None)  # a feature file's rows, by label (names may repeat)
    if held is not None and (own := held(classnames, templates)) is not None:
        return own
    texts = [t.format(c) for c in classnames for t in templates]
    raw = backbone.encode_text(texts)  # C*T, D
    return raw.reshape(len(classnames), len(templates), -1)


@torch.no_grad()
def text_prototypes(backbone: Backbone, classnames: Sequence[str], templates: Sequence[str]) -> torch.Tensor:
    """Geometry-space class prototypes [C, D]: every template per class, averaged by the geometry."""
    return prototypes_of(backbone.geometry, class_text_features(backbone, classnames, templates))


def prototypes_of(geometry, raw: torch.Tensor) -> torch.Tensor:
    """Class prototypes [C, D] from raw text-tower outputs [C, T, D]: embedded, then averaged by the geometry."""
    C, T, D = raw.shape
    return geometry.prototype(geometry.embed_text(raw.reshape(C * T, D)).reshape(C, T, -1))


def accuracy(logits: torch.Tensor, labels: torch.Tensor, classnames: Sequence[str]) -> dict:
    """Top-1 in percent, per-class accuracy in percent, their mean over the classes with test images (mean
    per-class accuracy, balanced accuracy: what an imbalanced test set's top-1 hides), the number of test images
    and the number per class (from which the accuracy of always answering the largest class follows)."""
    pred = logits.argmax(dim=-1).cpu()
    labels = labels.cpu()
    correct = (pred == labels).float()
    per_class, counts, rates = {}, {}, []
    for c, name in enumerate(class_keys(classnames)):  # a repeated name gets its label: no class is merged
        m = labels == c
        counts[name] = int(m.sum())
        if m.any():
            rates.append(float(correct[m].mean()))
        per_class[name] = round(100.0 * rates[-1], 4) if m.any() else None
    return {"top1": round(100.0 * float(correct.mean()), 4), "per_class": per_class,
            "mean_per_class": round(100.0 * sum(rates) / len(rates), 4) if rates else None,
            "n_test": int(labels.numel()), "n_test_per_class": counts}
