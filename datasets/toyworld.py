"""The toy world: procedural images of objects with attributes, and captions.

Everything is a pure function of ``(seed, index)``: no files, no downloads. An
image is one object drawn on a background; its attributes are

    shape       circle square triangle diamond cross star ring crescent
    colour      red green blue yellow purple orange cyan white
    size        small large
    position    left right top bottom center
    pattern     solid striped dotted checkered speckled
    background  black gray navy brown
    style       photo (default) | outline | sketch (see below)

Captions describe an image in varied words: synonyms, several word orders, and
attributes mentioned with different probabilities (shape almost always, colour
half the time, pattern and position half the time). That frequency is what
makes some downstream tasks easy for a CLIP model pretrained on these captions
and others hard, the way real CLIP is near-perfect on Caltech101 and weak on
EuroSAT or DTD.

The pretraining distribution also carries spurious correlations, as web data does
(``PRETRAIN_CORRELATION``): half of the time an object's colour follows its
pattern and the background follows the position. Downstream tasks draw every
attribute independently.

Rendering is vectorised over a batch with numpy: every shape mask is a few
array operations on a coordinate grid, so a batch of 32x32 images costs about
a hundred microseconds per image on one core.

Styles: ``photo`` is the pretraining distribution; ``outline`` draws only the
shape's border (10% of pretraining images, often captioned as drawings);
``sketch`` is rare in pretraining (2%): dark strokes on a pale, noisy
background, no fill, which is the distribution-shift task.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

IMAGE_SIZE = 32

SHAPES = ["circle", "square", "triangle", "diamond", "cross", "star", "ring", "crescent"]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "cyan", "white"]
SIZES = ["small", "large"]
POSITIONS = ["left", "right", "top", "bottom", "center"]
PATTERNS = ["solid", "striped", "dotted", "checkered", "speckled"]
BACKGROUNDS = ["black", "gray", "navy", "brown"]
STYLES = ["photo", "outline", "sketch"]

ATTRIBUTES: dict[str, list[str]] = {
    "shape": SHAPES,
    "colour": COLOURS,
    "size": SIZES,
    "position": POSITIONS,
    "pattern": PATTERNS,
    "background": BACKGROUNDS,
    "style": STYLES,
}

_RGB = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 235),
    "yellow": (235, 220, 50),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "cyan": (50, 215, 225),
    "white": (235, 235, 235),
}
_BG_RGB = {"black": (15, 15, 15), "gray": (110, 110, 110), "navy": (20, 25, 90), "brown": (95, 60, 30)}

# Object centre per position, in pixels of a 32x32 image (before jitter).
_POS_XY = {"left": (8.5, 16.0), "right": (23.5, 16.0), "top": (16.0, 8.5), "bottom": (16.0, 23.5), "center": (16.0, 16.0)}
_RADIUS = {"small": (6.0, 7.5), "large": (9.0, 11.0)}


# ---------------------------------------------------------------------------
# Counter-based randomness: uniform numbers as a pure function of (seed, index, stream)
# ---------------------------------------------------------------------------

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    z = x
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return z ^ (z >> np.uint64(31))


def uniform(seed: int, index: np.ndarray, stream: int) -> np.ndarray:
    """Uniform floats in [0, 1), one per index, determined by (seed, index, stream)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.full(1, seed, dtype=np.uint64) * np.uint64(0x100000001B3) + np.uint64(stream))
        h = _splitmix64(index.astype(np.uint64) ^ key)
        h = _splitmix64(h + key)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def choice(seed: int, index: np.ndarray, stream: int, n: int, p: Optional[Sequence[float]] = None) -> np.ndarray:
    u = uniform(seed, index, stream)
    if p is None:
        return np.minimum((u * n).astype(np.int64), n - 1)
    cdf = np.cumsum(np.asarray(p, dtype=np.float64))
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, u, side="right"), n - 1)


# ---------------------------------------------------------------------------
# Attributes
# ---------------------------------------------------------------------------


@dataclass
class Scene:
    """Attribute indices for a batch of images (one array entry per image)."""

    index: np.ndarray
    shape: np.ndarray
    colour: np.ndarray
    size: np.ndarray
    position: np.ndarray
    pattern: np.ndarray
    background: np.ndarray
    style: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def attrs(self, i: int) -> dict[str, str]:
        return {name: ATTRIBUTES[name][int(getattr(self, name)[i])] for name in ATTRIBUTES}


# Pretraining style mix: mostly photos, some outlines, rare sketches (rare is not absent).
PRETRAIN_STYLE_P = (0.88, 0.10, 0.02)

# Spurious correlations of the pretraining distribution, as web data has them (tigers are
# striped and orange): with probability PRETRAIN_CORRELATION an image's colour follows its
# pattern and its background follows its position. Caption words then carry a bit of the
# correlate ("striped" leans orange, "at the top" leans navy), so zero-shot prompts are
# biased on downstream tasks where the attributes are independent, and a few labelled
# images can correct the bias. Downstream tasks sample every attribute independently.
PRETRAIN_CORRELATION = 0.5
PATTERN_COLOUR = {"solid": "white", "striped": "orange", "dotted": "red", "checkered": "yellow",
                  "speckled": "green"}
POSITION_BACKGROUND = {"top": "navy", "bottom": "brown", "left": "gray", "right": "black"}


def sample_scene(
    seed: int,
    index: np.ndarray,
    fixed: Optional[dict[str, np.ndarray | int]] = None,
    style_p: Sequence[float] = PRETRAIN_STYLE_P,
    correlation: float = 0.0,
) -> Scene:
    """Draw attributes for each index; ``fixed`` pins some attributes (by index value).

    ``correlation`` > 0 ties colour to pattern and background to position with that
    probability (the pretraining distribution uses ``PRETRAIN_CORRELATION``).
    """
    index = np.asarray(index, dtype=np.int64)
    fixed = dict(fixed or {})
    vals = {}
    for s, (name, values) in enumerate(ATTRIBUTES.items()):
        if name in fixed:
            vals[name] = np.broadcast_to(np.asarray(fixed[name], dtype=np.int64), index.shape).copy()
        elif name == "style":
            vals[name] = choice(seed, index, 100 + s, len(values), style_p)
        else:
            vals[name] = choice(seed, index, 100 + s, len(values))
    if correlation > 0:
        tie = uniform(seed, index, 150) < correlation
        lut = np.array([COLOURS.index(PATTERN_COLOUR[p]) for p in PATTERNS])
        if "colour" not in fixed:
            vals["colour"] = np.where(tie, lut[vals["pattern"]], vals["colour"])
        tie = uniform(seed, index, 151) < correlation
        lut = np.array([BACKGROUNDS.index(POSITION_BACKGROUND.get(p, "black")) for p in POSITIONS])
        has = np.array([p in POSITION_BACKGROUND for p in POSITIONS])[vals["position"]]
        if "background" not in fixed:
            vals["background"] = np.where(tie & has, lut[vals["position"]], vals["background"])
    return Scene(index=index, **vals)


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------

_YY, _XX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5


def _shape_masks(shape: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside-masks [B,H,W] for each image's shape, in normalised coords u, v."""
    rho = np.sqrt(u * u + v * v)
    theta = np.arctan2(v, u)
    au, av = np.abs(u), np.abs(v)
    masks = [
        rho <= 1.0,  # circle
        np.maximum(au, av) <= 0.82,  # square
        (v <= 0.75) & (v >= -0.95) & (au <= (v + 0.95) * 0.62),  # triangle, apex up
        au + av <= 1.0,  # diamond
        ((au <= 0.3) & (av <= 1.0)) | ((av <= 0.3) & (au <= 1.0)),  # cross
        rho <= 0.42 + 0.58 * ((np.cos(5 * (theta + math.pi / 2)) + 1) / 2) ** 2,  # five-pointed star
        (rho <= 1.0) & (rho >= 0.55),  # ring
        (rho <= 1.0) & ((u - 0.5) ** 2 + (v + 0.1) ** 2 >= 0.72**2),  # crescent
    ]
    stack = np.stack(masks, axis=1)  # B, 8, H, W
    return np.take_along_axis(stack, shape[:, None, None, None], axis=1)[:, 0]


def _border(mask: np.ndarray) -> np.ndarray:
    """Pixels of the mask that touch a pixel outside it (4-neighbourhood)."""
    m = np.pad(mask, ((0, 0), (1, 1), (1, 1)), constant_values=False)
    inner = m[:, 1:-1, 1:-1] & m[:, :-2, 1:-1] & m[:, 2:, 1:-1] & m[:, 1:-1, :-2] & m[:, 1:-1, 2:]
    return mask & ~inner


def render(scene: Scene, seed: int) -> np.ndarray:
    """Render a batch: uint8 array [B, H, W, 3]."""
    idx = scene.index
    B = len(idx)
    U = lambda stream: uniform(seed, idx, stream).astype(np.float32)  # noqa: E731

    base_xy = np.array([_POS_XY[p] for p in POSITIONS], dtype=np.float32)[scene.position]  # B, 2
    cx = base_xy[:, 0] + (U(1) - 0.5) * 4.0
    cy = base_xy[:, 1] + (U(2) - 0.5) * 4.0
    rmin = np.array([_RADIUS[s][0] for s in SIZES], dtype=np.float32)[scene.size]
    rmax = np.array([_RADIUS[s][1] for s in SIZES], dtype=np.float32)[scene.size]
    r = rmin + (rmax - rmin) * U(3)
    rot = (U(4) - 0.5) * (math.pi / 12)  # +-7.5 degrees

    dx = (_XX[None] - cx[:, None, None]) / r[:, None, None]
    dy = (_YY[None] - cy[:, None, None]) / r[:, None, None]
    c, s = np.cos(rot)[:, None, None], np.sin(rot)[:, None, None]
    u, v = c * dx + s * dy, -s * dx + c * dy
    mask = _shape_masks(scene.shape, u, v)  # B, H, W

    # Colours with jitter.
    obj = np.array([_RGB[c] for c in COLOURS], dtype=np.float32)[scene.colour]  # B, 3
    obj = obj * (0.85 + 0.25 * U(5))[:, None] + (np.stack([U(6), U(7), U(8)], 1) - 0.5) * 40
    bg = np.array([_BG_RGB[b] for b in BACKGROUNDS], dtype=np.float32)[scene.background]
    bg = bg + (np.stack([U(9), U(10), U(11)], 1) - 0.5) * 30
    # A soft vertical gradient on the background.
    grad = (_YY[None] / IMAGE_SIZE - 0.5) * (U(12) - 0.5)[:, None, None] * 60

    # Pattern: a [B,H,W] factor in (0,1] that darkens parts of the object.
    ox, oy = _XX[None] + (U(13) * 8)[:, None, None], _YY[None] + (U(14) * 8)[:, None, None]
    period = 4.0
    striped = (np.floor((ox + oy) / (period / 1.0)) % 2) == 0
    dotted = ((ox % period) - period / 2) ** 2 + ((oy % period) - period / 2) ** 2 <= 1.3
    checkered = ((np.floor(ox / 3) + np.floor(oy / 3)) % 2) == 0
    noise_px = uniform(seed, (idx[:, None] * 4096 + np.arange(IMAGE_SIZE * IMAGE_SIZE)[None]).ravel(), 15)
    noise_px = noise_px.reshape(B, IMAGE_SIZE, IMAGE_SIZE).astype(np.float32)
    speckled = noise_px < 0.5
    factors = np.stack(
        [
            np.ones_like(striped, dtype=np.float32),
            np.where(striped, 1.0, 0.55),
            np.where(dotted, 1.0, 0.55),
            np.where(checkered, 1.0, 0.55),
            np.where(speckled, 1.0, 0.6),
        ],
        axis=1,
    ).astype(np.float32)
    fac = np.take_along_axis(factors, scene.pattern[:, None, None, None], axis=1)[:, 0]

    img = bg[:, None, None, :] + grad[..., None]
    photo = np.where(mask[..., None], obj[:, None, None, :] * fac[..., None], img)

    style = scene.style
    out = photo
    if np.any(style > 0):
        border = _border(mask)
        thick = border | _border(mask & ~border)  # two pixels wide
        outline = np.where(thick[..., None], obj[:, None, None, :], img)
        paper = 190 + 50 * U(16)[:, None, None, None] + (noise_px[..., None] - 0.5) * 60
        ink = obj[:, None, None, :] * 0.35
        sketch = np.where(thick[..., None], ink, np.broadcast_to(paper, photo.shape))
        out = np.where((style == 1)[:, None, None, None], outline, out)
        out = np.where((style == 2)[:, None, None, None], sketch, out)

    # Sensor noise.
    grain = (uniform(seed, (idx[:, None] * 4096 + np.arange(IMAGE_SIZE * IMAGE_SIZE)[None]).ravel(), 17) - 0.5)
    out = out + grain.reshape(B, IMAGE_SIZE, IMAGE_SIZE, 1).astype(np.float32) * 16
    return np.clip(out, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------
# Captions
# ---------------------------------------------------------------------------

_SHAPE_WORDS = {
    "circle": ["circle"] * 4 + ["disc"],
    "square": ["square"] * 4 + ["box"],
    "triangle": ["triangle"],
    "diamond": ["diamond"] * 4 + ["rhombus"],
    "cross": ["cross"] * 4 + ["plus sign"],
    "star": ["star"],
    "ring": ["ring"] * 4 + ["donut"],
    "crescent": ["crescent"] * 4 + ["moon"],
}
_COLOUR_WORDS = {c: [c] for c in COLOURS}
_COLOUR_WORDS["purple"] = ["purple", "purple", "violet"]
_COLOUR_WORDS["cyan"] = ["cyan", "cyan", "turquoise"]
_SIZE_WORDS = {"small": ["small", "tiny", "little"], "large": ["large", "big", "huge"]}
_POSITION_PHRASES = {
    "left": ["on the left", "at the left", "on the left side"],
    "right": ["on the right", "at the right", "on the right side"],
    "top": ["at the top", "near the top", "in the upper part"],
    "bottom": ["at the bottom", "near the bottom", "in the lower part"],
    "center": ["in the center", "in the middle", "at the center"],
}
_PATTERN_ADJ = {
    "solid": ["plain", "solid"],
    "striped": ["striped", "stripy"],
    "dotted": ["dotted", "spotted"],
    "checkered": ["checkered", "chequered"],
    "speckled": ["speckled", "grainy"],
}
_PATTERN_WITH = {
    "solid": ["with a plain fill", "with a solid fill"],
    "striped": ["with stripes", "with diagonal stripes"],
    "dotted": ["with dots", "with polka dots"],
    "checkered": ["with a checkerboard pattern", "with checks"],
    "speckled": ["with speckles", "with a speckled texture"],
}
_BG_PHRASES = {b: [f"on a {b} background", f"against a {b} background", f"on {b}"] for b in BACKGROUNDS}
_OPENERS = ["a", "a photo of a", "an image of a", "a picture of a", "there is a", "this is a"]
_DRAWING_OPENERS = ["a drawing of a", "an outline of a", "a line drawing of a", "a sketch of a"]

# How often each attribute is named in a caption.
MENTION_P = {"shape": 0.95, "colour": 0.5, "size": 0.3, "pattern": 0.5, "position": 0.5, "background": 0.2}


def _pick(options: Sequence[str], u: float) -> str:
    return options[min(int(u * len(options)), len(options) - 1)]


def captions(scene: Scene, seed: int) -> list[str]:
    """One caption per image of the batch, deterministic by (seed, index)."""
    idx = scene.index
    us = {k: uniform(seed, idx, 200 + i) for i, k in enumerate(
        ["m_shape", "m_colour", "m_size", "m_pattern", "m_position", "m_bg",
         "w_shape", "w_colour", "w_size", "w_pattern", "w_position", "w_bg",
         "opener", "pat_form", "order", "drawing_said"])}
    out = []
    for i in range(len(idx)):
        a = scene.attrs(i)
        g = {k: float(v[i]) for k, v in us.items()}
        said = {k: g["m_" + k] < p for k, p in MENTION_P.items() if k != "background"}
        said["background"] = g["m_bg"] < MENTION_P["background"]
        adj = []
        if said["size"]:
            adj.append(_pick(_SIZE_WORDS[a["size"]], g["w_size"]))
        if said["colour"]:
            adj.append(_pick(_COLOUR_WORDS[a["colour"]], g["w_colour"]))
        pattern_after = None
        if said["pattern"]:
            if g["pat_form"] < 0.5:
                adj.append(_pick(_PATTERN_ADJ[a["pattern"]], g["w_pattern"]))
            else:
                pattern_after = _pick(_PATTERN_WITH[a["pattern"]], g["w_pattern"])
        noun = _pick(_SHAPE_WORDS[a["shape"]], g["w_shape"]) if said["shape"] else _pick(["shape", "object", "thing"], g["w_shape"])
        tail = []
        if pattern_after:
            tail.append(pattern_after)
        if said["position"]:
            tail.append(_pick(_POSITION_PHRASES[a["position"]], g["w_position"]))
        if said["background"] and a["style"] != "sketch":
            tail.append(_pick(_BG_PHRASES[a["background"]], g["w_bg"]))
        if g["order"] < 0.5:
            tail = tail[::-1]
        drawing = a["style"] != "photo" and g["drawing_said"] < 0.7
        opener = _pick(_DRAWING_OPENERS if drawing else _OPENERS, g["opener"])
        words = (" ".join([opener] + adj + [noun] + tail)).split()
        # "a orange star" -> "an orange star"
        for j in range(len(words) - 1):
            if words[j] == "a" and words[j + 1][0] in "aeiou":
                words[j] = "an"
        out.append(" ".join(words))
    return out


def vocabulary() -> list[str]:
    """Every word the captions, class names and templates of the toy world use."""
    words = set()
    tables = [_SHAPE_WORDS, _COLOUR_WORDS, _SIZE_WORDS, _POSITION_PHRASES, _PATTERN_ADJ, _PATTERN_WITH, _BG_PHRASES]
    for table in tables:
        for phrases in table.values():
            for ph in phrases:
                words.update(ph.split())
    for ph in _OPENERS + _DRAWING_OPENERS + ["shape", "object", "thing"]:
        words.update(ph.split())
    for values in ATTRIBUTES.values():
        words.update(values)
    # Words used by the toy tasks' prompt templates.
    words.update("an the of in with pattern texture object shape photo drawing placed located colour color fill".split())
    return sorted(words)


def render_items(seed: int, index: np.ndarray, fixed: Optional[dict[str, np.ndarray | int]] = None,
                 style_p: Sequence[float] = PRETRAIN_STYLE_P) -> np.ndarray:
    """Convenience: sample scenes and render them in one call."""
    return render(sample_scene(seed, index, fixed, style_p), seed)
