"""Downstream classification tasks on the toy world (no files needed).

Each task fixes one attribute to the class label and draws the others at
random. Item ids are ``"<split>/<index>"``; the image is rendered from
``(task seed, split offset + index)``, so it is the same on every machine.

| task            | label     | classes | what makes it hard                                           |
|-----------------|-----------|---------|--------------------------------------------------------------|
| toy-shapes      | shape     | 8       | little: clean photos, shapes named in 95% of captions        |
| toy-sketch      | shape     | 8       | a drawing style that is 2% of pretraining                    |
| toy-patterns    | pattern   | 5       | grainy, low-contrast scans (noise 25, contrast 0.45)         |
| toy-positions   | position  | 5       | low-contrast, noisy images (noise 60, contrast 0.4)          |
| toy-colours     | colour    | 8       | faded, noisy images (contrast 0.3, noise 40)                 |

The rendering shifts (``noise``, ``contrast``) are applied after the toy world's
own rendering and never occur in pretraining: like a real benchmark whose
images differ from web photos, they leave zero-shot real but imperfect, while
the frozen image features still carry the label, so a few labelled images help.
The first template of every task is the plain "a photo of a {}." that
``data.templates=single`` (and CoOp's protocol) uses; the rest form the ensemble.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from . import toyworld as tw
from .base import DataConfig, Dataset, Item, register_dataset

_SPLIT_OFFSET = {"train": 0, "val": 10_000_000, "test": 20_000_000}


@dataclass(frozen=True)
class ToyTaskSpec:
    name: str
    attribute: str
    classnames: Tuple[str, ...]
    templates: Tuple[str, ...]
    fixed: Tuple[Tuple[str, str], ...] = ()  # attributes pinned for every image
    # The attribute value each class shows, when the class names are other words (default: the names).
    values: Tuple[str, ...] = ()
    style: str = "photo"
    per_class: Tuple[int, int, int] = (64, 16, 100)  # train, val, test images per class
    hflip_ok: bool = True
    # Rendering shift applied on top of the toy world's own rendering (never seen in pretraining):
    # extra per-pixel noise of this amplitude (0-255 scale) and contrast towards mid-gray.
    noise: float = 0.0
    contrast: float = 1.0
    # RandomResizedCrop's smallest area for few-shot training; small 32x32 scenes keep most of the image.
    min_crop_scale: float = 0.8
    description: str = ""

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF


# The first template of every task is CoOp's plain "a photo of a {}." (what `data.templates=single`
# uses, and what a user writes first); the rest are hand-engineered for the task (the ensemble).
_SHAPE_TEMPLATES = (
    "a photo of a {}.",
    "a {}.",
    "a picture of a {}.",
    "an image of a {} shape.",
    "a {} on a background.",
)

TASKS: Dict[str, ToyTaskSpec] = {}


def _add(spec: ToyTaskSpec) -> None:
    TASKS[spec.name] = spec


_add(ToyTaskSpec(
    name="toy-shapes",
    attribute="shape",
    classnames=tuple(tw.SHAPES),
    templates=_SHAPE_TEMPLATES,
    description="8 shapes, photo style, other attributes random (easy for zero-shot)",
))
_add(ToyTaskSpec(
    name="toy-patterns",
    attribute="pattern",
    classnames=tuple(tw.PATTERNS),
    templates=(
        "a photo of a {}.",
        "a photo of a {} shape.",
        "a {} object.",
        "a {} pattern.",
        "a shape with a {} texture.",
    ),
    fixed=(("size", "large"),),
    noise=25.0,
    contrast=0.45,
    description="5 fill patterns (texture) of large objects in grainy, low-contrast scans: a rendering shift",
))
_add(ToyTaskSpec(
    name="toy-positions",
    attribute="position",
    classnames=tuple(tw.POSITIONS),
    templates=(
        "a photo of a {}.",
        "a photo of a shape at the {}.",
        "an object at the {}.",
        "a shape in the {}.",
        "a picture of an object at the {}.",
    ),
    hflip_ok=False,  # a horizontal flip swaps left and right
    min_crop_scale=0.9,  # a small crop moves the object: keep crops large
    noise=60.0,
    contrast=0.4,
    description="where the object is (5 positions) in low-contrast, noisy images: a rendering shift",
))
_add(ToyTaskSpec(
    name="toy-sketch",
    attribute="shape",
    classnames=tuple(tw.SHAPES),
    templates=_SHAPE_TEMPLATES,
    style="sketch",
    description="8 shapes drawn as dark strokes on pale noisy paper: a style rare in pretraining (distribution shift)",
))


_add(ToyTaskSpec(
    name="toy-colours",
    attribute="colour",
    classnames=tuple(tw.COLOURS),
    templates=("a photo of a {}.", "a {} shape.", "a {} object."),
    contrast=0.3,
    noise=40.0,
    description="the object's colour (8 classes) in faded, noisy images (contrast 0.3): a rendering shift",
))


class ToyTask(Dataset):
    """A toy-world task; images are rendered on demand and cached per split."""

    def __init__(self, spec: ToyTaskSpec):
        C = len(spec.classnames)
        splits = {}
        for split, n in zip(("train", "val", "test"), spec.per_class):
            splits[split] = [Item(f"{split}/{i}", i % C) for i in range(n * C)]
        super().__init__(name=spec.name, classnames=list(spec.classnames), templates=list(spec.templates),
                         splits=splits)
        self.spec = spec
        self.hflip_ok = spec.hflip_ok
        self.min_crop_scale = spec.min_crop_scale
        self._cache: Dict[str, np.ndarray] = {}

    def _fixed(self, labels: np.ndarray) -> Dict[str, np.ndarray]:
        values = self.spec.values or self.spec.classnames
        lut = np.array([tw.ATTRIBUTES[self.spec.attribute].index(v) for v in values], dtype=np.int64)
        fixed: Dict[str, np.ndarray] = {self.spec.attribute: lut[labels]}
        for attr, value in self.spec.fixed:
            fixed[attr] = np.full_like(labels, tw.ATTRIBUTES[attr].index(value))
        fixed["style"] = np.full_like(labels, tw.STYLES.index(self.spec.style))
        return fixed

    def render_split(self, split: str) -> np.ndarray:
        """All images of a split, uint8 [N, H, W, 3] (rendered once, then cached)."""
        if split not in self._cache:
            n = len(self.splits[split])
            C = len(self.classnames)
            local = np.arange(n, dtype=np.int64)
            index = local + _SPLIT_OFFSET[split]
            labels = local % C
            chunks = []
            for s in range(0, n, 2048):
                sl = slice(s, s + 2048)
                scene = tw.sample_scene(self.spec.seed, index[sl], self._fixed(labels[sl]))
                chunks.append(self._shift(tw.render(scene, self.spec.seed), index[sl]))
            self._cache[split] = np.concatenate(chunks) if chunks else np.zeros((0, 32, 32, 3), np.uint8)
        return self._cache[split]

    def _shift(self, images: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The task's rendering shift: lower contrast, then uniform per-pixel noise."""
        spec = self.spec
        if spec.noise == 0 and spec.contrast == 1.0:
            return images
        x = images.astype(np.float32)
        x = 128 + (x - 128) * spec.contrast
        if spec.noise:
            n = x[0].size
            keys = (index[:, None].astype(np.int64) * n + np.arange(n)[None]).ravel()
            u = tw.uniform(spec.seed, keys, 300).reshape(x.shape).astype(np.float32)
            x = x + (u - 0.5) * 2 * spec.noise
        return np.clip(x, 0, 255).astype(np.uint8)

    def load_image(self, item: Item) -> Image.Image:
        split, _, i = item.id.partition("/")
        return Image.fromarray(self.render_split(split)[int(i)])


def _builder(name: str):
    def build(cfg: DataConfig) -> Dataset:
        return ToyTask(TASKS[name])

    return build


for _name, _spec in TASKS.items():
    register_dataset(
        _name,
        _builder(_name),
        description=f"toy world: {_spec.description}",
        layout="(none: rendered procedurally, no files needed)",
        needs_root=False,
    )
