"""Downstream classification tasks on the toy world (no files needed).

Each task fixes one attribute (toy-objects: two) to the class label and draws
the others at random. Item ids are ``"<split>/<index>"``; the image is rendered
from ``(task seed, split offset + index)``, so it is the same on every machine.

| task               | label        | classes | what makes it hard                                        |
|--------------------|--------------|---------|-----------------------------------------------------------|
| toy-shapes         | shape        | 8       | little: clean photos, shapes named in 95% of captions     |
| toy-sketch         | shape        | 8       | a drawing style that is 2% of pretraining                 |
| toy-patterns       | pattern      | 5       | grainy, low-contrast scans (noise 25, contrast 0.45)      |
| toy-positions      | position     | 5       | low-contrast, noisy images (noise 60, contrast 0.4)       |
| toy-colours        | colour       | 8       | faded, noisy images (contrast 0.3, noise 40)              |
| toy-objects        | colour+shape | 64      | faded, grainy images (noise 25, contrast 0.5)             |
| toy-shapes-outline | shape        | 4       | outlines (10% of pretraining) of 4 of the 8 shapes        |
| toy-shapes-faded   | shape        | 8       | faded, grainy images (noise 30, contrast 0.45)            |

The last three serve the generalisation protocols (``fewclip.datasets.protocols``):
toy-objects for base-to-novel (32 base, 32 new classes) and as the source of
cross-dataset transfer to the first five; toy-sketch, toy-shapes-outline and
toy-shapes-faded as shifted versions of toy-shapes (domain generalisation).

The rendering shifts (``noise``, ``contrast``) are applied after the toy world's
own rendering and never occur in pretraining: like a real benchmark whose
images differ from web photos, they leave zero-shot real but imperfect, while
the frozen image features still carry the label, so a few labelled images help.
The first template of every task is the plain "a photo of a {}." that
``data.templates=single`` (and CoOp's protocol) uses; the rest form the ensemble.
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

import fewclip.datasets.toyworld as tw
from fewclip.data.base import DataConfig, Dataset, Item, register_dataset
from fewclip.utils.checksums import code_sha256

_SPLIT_OFFSET = {"train": 0, "val": 10_000_000, "test": 20_000_000}


@dataclass(frozen=True)
class ToyTaskSpec:
    name: str
    # The attribute the label fixes, or several joined by "+" ("colour+shape"): then each class
    # shows one value of each, and its name (or ``values`` entry) lists them in that order.
    attribute: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    fixed: tuple[tuple[str, str], ...] = ()  # attributes pinned for every image
    # The attribute value(s) each class shows, when the class names are other words (default: the names);
    # for several attributes, the values separated by spaces ("red circle").
    values: tuple[str, ...] = ()
    style: str = "photo"
    per_class: tuple[int, int, int] = (64, 16, 100)  # train, val, test images per class
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

    @property
    def attributes(self) -> tuple[str, ...]:
        return tuple(self.attribute.split("+"))

    def class_values(self) -> list[dict[str, str]]:
        """Per class, the value it shows of each labelled attribute: ``[{"colour": "red", "shape": "circle"}, ...]``."""
        out = []
        for v in self.values or self.classnames:
            words = v.split()
            if len(words) != len(self.attributes):
                raise ValueError(f"toy task {self.name!r}: class value {v!r} does not name one value of each "
                                 f"of {self.attributes}")
            out.append(dict(zip(self.attributes, words)))
        return out


# The first template of every task is CoOp's plain "a photo of a {}." (what `data.templates=single`
# uses, and what a user writes first); the rest are hand-engineered for the task (the ensemble).
_SHAPE_TEMPLATES = (
    "a photo of a {}.",
    "a {}.",
    "a picture of a {}.",
    "an image of a {} shape.",
    "a {} on a background.",
)

TASKS: dict[str, ToyTaskSpec] = {}


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


# Three tasks for the generalisation protocols (see fewclip.datasets.protocols). toy-objects has 64 classes,
# enough for base-to-novel (CoCoOp's rule: the first 32 labels, the colours red, green, blue and yellow on
# every shape, are base; purple, orange, cyan and white are new), and is the source of the toy
# cross-dataset transfer. toy-shapes-outline and toy-shapes-faded are, with toy-sketch, the shifted
# versions of toy-shapes; toy-shapes-outline holds half of its classes, as ImageNet-A and -R hold 200
# of ImageNet's 1000.
_add(ToyTaskSpec(
    name="toy-objects",
    attribute="colour+shape",
    classnames=tuple(f"{c} {s}" for c in tw.COLOURS for s in tw.SHAPES),
    templates=(
        "a photo of a {}.",
        "a {}.",
        "a picture of a {}.",
        "an image of a {}.",
        "a {} on a background.",
    ),
    noise=25.0,
    contrast=0.5,
    description="64 coloured objects (8 colours x 8 shapes, 'red circle') in faded, grainy images: "
                "base-to-novel and the source of cross-dataset transfer",
))
_add(ToyTaskSpec(
    name="toy-shapes-outline",
    attribute="shape",
    classnames=("circle", "triangle", "cross", "ring"),
    templates=_SHAPE_TEMPLATES,
    style="outline",
    description="4 of toy-shapes' 8 shapes drawn as outlines (10% of pretraining): a domain-shift target "
                "of toy-shapes with a subset of its classes",
))
_add(ToyTaskSpec(
    name="toy-shapes-faded",
    attribute="shape",
    classnames=tuple(tw.SHAPES),
    templates=_SHAPE_TEMPLATES,
    noise=30.0,
    contrast=0.45,
    description="toy-shapes' 8 shapes in faded, grainy images: a domain-shift target of toy-shapes",
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
        self.generator = generator_identity(spec)
        self._cache: dict[str, np.ndarray] = {}

    def _fixed(self, labels: np.ndarray) -> dict[str, np.ndarray]:
        fixed: dict[str, np.ndarray] = {}
        per_class = self.spec.class_values()
        for attr in self.spec.attributes:
            lut = np.array([tw.ATTRIBUTES[attr].index(v[attr]) for v in per_class], dtype=np.int64)
            fixed[attr] = lut[labels]
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


_CODE_DIGEST: dict[str, str] = {}


def generator_identity(spec: ToyTaskSpec) -> str:
    """What a task's images are a function of: its spec and the code that renders them (this module and the
    toy world's; their code, not their docstrings or comments: ``code_sha256``), as a digest. The feature store
    compares it before it serves a task's features, so an edit of the renderer never serves features of the old
    pixels."""
    if not _CODE_DIGEST:
        _CODE_DIGEST["code"] = code_sha256(tw.__file__, __file__)
    return "toyworld:" + hashlib.sha256(f"{_CODE_DIGEST['code']}/{spec!r}".encode()).hexdigest()[:32]


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
