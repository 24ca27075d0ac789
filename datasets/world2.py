"""World 2: a procedural image world of hundreds of named concepts, for reference backbones whose few-shot
behaviour resembles a real CLIP's (issue 31).

The first toy world (``toyworld``) has 8 shapes x 8 colours x 5 patterns; its tasks have 5-8 classes, its new
classes differ from the base ones by a colour word, and its image tower does not cluster images by class. World 2
is built so that each of those causes is absent:

* **Concepts, not attribute combinations.** 610 concepts in 9 families (``FAMILIES``). Each concept has a
  name of its own (a pseudo-word such as ``"vorabe"``, one token), a visual prototype (a shape, two colours, a
  fill texture and a part for objects; a layout for scenes; a wave pattern for textures; a field pattern for
  land), and images vary around that prototype (pose, scale, position, colour jitter, background, noise). A
  class is one concept, so images of a class resemble one another more than images of other classes: an image
  tower trained on it clusters by class, which cache methods, TransCLIP and low-shot probes need.
* **Generic and fine-grained families.** In a generic family (``thing``) every concept's prototype is drawn
  independently; in a fine-grained family (``car``, ``plane``, ...) all concepts perturb one family prototype by
  a small ``spread``, so they differ in details (harder for zero-shot and for a 1-shot probe alike).
* **Names the text tower knows, frequencies that differ.** Pretraining captions name a concept with a
  family-specific probability (``name_p``) and draw concepts with a Zipf law inside each family, so head
  concepts and families named often (``thing``) give a strong zero-shot and tail ones and rarely named families
  (``plane``, ``land``) a weak one. When the name is not said, the caption says the family word and attribute
  words (colour, fill), which ties the text tower's name embeddings to what the images show.
* **Captions that describe more than they name** (``describe``): shape, proportions, size, the part and where
  it sits, the second colour; textures' orientation and grain; scenes' blocks and horizon; land's roads. The
  image tower learns what these say, so its features hold more than the names tell apart, and shots have
  something to add over zero-shot (an image tower trained on names alone left a 16-shot probe near zero-shot).
* **Captions as the web writes them.** Up to 14 filler words may open a caption, so a name is read at every
  position up to the context's end, where CoOp's 16 context vectors put it; and each family's photos are
  mostly captioned in its own way (``Family.openers``: "a satellite photo of", "a close up of a"), so "a photo
  of a {}." is a generic prompt that a learned or hand-made domain context beats, as on EuroSAT or DTD.
* **A mirror-symmetric world.** Half of all images are mirrored, so a flipped training view (CoOp's
  augmentation) shows the same concept; without it, a flipped view looked like another concept.
* **Styles.** ``photo`` (70% of pretraining), ``cartoon`` (flat colours, outlines: 12%), ``sketch`` (dark
  strokes on paper: 10%) and ``hard`` (small, occluded, low-contrast: 8%): the rendering shifts of the
  ImageNet-like domain-shift family (``world2tasks``).

Everything is a pure function of ``(seed, index)`` through ``toyworld``'s counter-based ``uniform``: no files.
Images are 32x32 RGB, as in the first world, so the same tiny towers fit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np

from fewclip.datasets.toyworld import uniform

IMAGE_SIZE = 32
WORLD_SEED = 31_031  # the concept catalogue's seed: names and prototypes
STYLES = ("photo", "cartoon", "sketch", "hard")
PRETRAIN_STYLE_P = (0.70, 0.12, 0.10, 0.08)  # at 4% / 3% sketch and hard stayed near chance


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # object | texture | scene | land
    n: int  # concepts
    word: str  # the family word captions and templates use ("car")
    spread: float  # 1 = independent prototypes (generic), small = fine-grained
    name_p: float  # how often a pretraining caption names the concept
    weight: float  # share of pretraining images
    zipf: float = 1.0  # concept frequency ~ rank^-zipf inside the family
    openers: tuple[str, ...] = ()  # how the web captions this family's photos (a satellite image, a close-up)
    opener_p: float = 0.0  # how often a photo's caption opens so, instead of "a photo of a"
    confuse_p: float = 0.1  # how often a caption that names a concept names its confuser instead (see confusers)


FAMILIES: tuple[Family, ...] = (
    Family("thing", "object", 120, "object", 1.0, 0.9, 0.22, 0.6),
    Family("beast", "object", 40, "animal", 0.45, 0.8, 0.09, openers=("a pet photo of a", "my pet"), opener_p=0.5),
    Family("car", "object", 80, "car", 0.22, 0.6, 0.11, openers=("a car photo of a", "a parked"), opener_p=0.6),
    Family("bloom", "object", 80, "flower", 0.4, 0.7, 0.11, openers=("a garden photo of a", "a bunch of"),
           opener_p=0.6),
    Family("dish", "object", 60, "food", 0.5, 0.75, 0.09, openers=("a food photo of a", "a plate of"), opener_p=0.5),
    Family("plane", "object", 80, "aircraft", 0.15, 0.35, 0.08, 1.2, openers=("an airshow photo of a",
           "a spotted"), opener_p=0.8),
    Family("texture", "texture", 40, "texture", 0.6, 0.6, 0.08, openers=("a close up of a", "a surface of"),
           opener_p=0.8),
    Family("scene", "scene", 100, "place", 0.6, 0.7, 0.18, openers=("a view of a", "a wide shot of a"),
           opener_p=0.6),
    Family("land", "land", 10, "land", 1.0, 0.25, 0.04, openers=("a satellite photo of", "an aerial view of"),
           opener_p=0.9),
)
FAMILY_INDEX = {f.name: i for i, f in enumerate(FAMILIES)}

COLOUR_WORDS = {
    "red": (210, 40, 40), "green": (50, 170, 60), "blue": (50, 80, 220), "yellow": (230, 210, 50),
    "purple": (140, 60, 190), "orange": (240, 140, 30), "pink": (240, 140, 190), "brown": (120, 75, 35),
    "white": (235, 235, 235), "black": (25, 25, 25), "gray": (128, 128, 128),
}
FILLS = ("plain", "striped", "dotted", "ringed")
STYLE_OPENERS = {
    "photo": ("a photo of a", "a picture of a", "an image of a", "a", "this is a", "a close photo of a"),
    "cartoon": ("a cartoon of a", "a rendering of a", "a drawing of a"),
    "sketch": ("a sketch of a", "a pencil sketch of a", "a drawing of a"),
    "hard": ("a blurry photo of a", "a dark photo of a", "a photo of a small"),
}
_SYL_C = "bdfgklmnprstvz"
_SYL_V = "aeiou"


@dataclass(frozen=True)
class Concept:
    id: int
    family: str
    rank: int  # rank inside its family (0 = most frequent in pretraining)
    name: str
    params: tuple[float, ...]  # the prototype, kind-specific (see _prototype)
    colour: str  # the colour word closest to the main colour
    fill: str


def _name(i: int, taken: set) -> str:
    """A pronounceable pseudo-word for concept ``i`` (3 syllables), unique in the catalogue."""
    k = 0
    while True:
        u = uniform(WORLD_SEED, np.array([i * 64 + k]), 7)[0]
        x = int(u * 1e12)
        syl = []
        for _ in range(3):
            syl.append(_SYL_C[x % len(_SYL_C)] + _SYL_V[(x // 14) % len(_SYL_V)])
            x //= 70
        w = "".join(syl)
        if w not in taken:
            taken.add(w)
            return w
        k += 1


N_PARAMS = 16


def _nearest_colour(rgb: np.ndarray) -> str:
    names = list(COLOUR_WORDS)
    ref = np.array([COLOUR_WORDS[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(((ref - rgb) ** 2).sum(1)))]


@lru_cache(maxsize=1)
def catalogue() -> tuple[Concept, ...]:
    """Every concept of the world, in family order (ids 0..609), deterministic."""
    out: list[Concept] = []
    taken: set = set()
    cid = 0
    for fi, fam in enumerate(FAMILIES):
        # The family prototype and each concept's offset from it, in [0, 1) parameter space.
        proto = uniform(WORLD_SEED, np.arange(N_PARAMS) + fi * 1000, 11)
        for r in range(fam.n):
            u = uniform(WORLD_SEED, np.arange(N_PARAMS) + cid * 100 + 100_000, 12)
            p = proto + fam.spread * (u - proto) if fam.spread < 1 else u
            # colours are free in generic families and in flowers, food and textures (what tells them apart)
            if fam.name in ("bloom", "dish", "texture", "beast"):
                p[8:14] = u[8:14]
            p = np.clip(p, 0, 1)
            rgb = _palette(p[8:11])
            fill = FILLS[min(int(p[14] * len(FILLS)), len(FILLS) - 1)] if fam.kind == "object" else "plain"
            out.append(Concept(cid, fam.name, r, _name(cid, taken), tuple(float(x) for x in p),
                               _nearest_colour(rgb), fill))
            cid += 1
    return tuple(out)


def _palette(p3: np.ndarray) -> np.ndarray:
    """Three [0,1) parameters -> a saturated RGB colour (hue, saturation, value)."""
    h, s, v = p3[..., 0], 0.35 + 0.65 * p3[..., 1], 0.35 + 0.65 * p3[..., 2]
    k = lambda n: (n + h * 6) % 6  # noqa: E731
    f = lambda n: v - v * s * np.clip(np.minimum(k(n), 4 - k(n)), 0, 1)  # noqa: E731
    return np.stack([f(5), f(3), f(1)], -1) * 255


@lru_cache(maxsize=1)
def confusers() -> tuple[int, ...]:
    """Each concept's confuser: a fixed other concept of its family (drawn once from the concept's id), whose name
    the web's captions sometimes give it (``Family.confuse_p``), as alt-text calls one sparrow another.

    Why: with clean names, prompts learned on base classes carried over to new ones (CoOp's new-class accuracy
    stayed at or above zero-shot; the field's finding 1 is the opposite). Misnamed captions make a name's text
    embedding a blend of two concepts, which zero-shot averages over and base-class training fits to its own
    classes; at 10% CoOp's new-class accuracy fell below zero-shot on the fine-grained tasks (docs/world2.md)."""
    out = []
    for fam in FAMILIES:
        ids = [c.id for c in catalogue() if c.family == fam.name]
        for k, cid in enumerate(ids):
            shift = int(np.random.default_rng(cid).integers(1, len(ids)))
            out.append(ids[(k + shift) % len(ids)])
    return tuple(out)


def concepts_of(family: str) -> list[Concept]:
    return [c for c in catalogue() if c.family == family]


def concept_by_name() -> dict[str, Concept]:
    return {c.name: c for c in catalogue()}


# ---------------------------------------------------------------------------
# Sampling: which concept and style each image shows
# ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def pretrain_concept_p() -> np.ndarray:
    """Probability of each concept in pretraining: family weight x Zipf inside the family."""
    p = np.zeros(len(catalogue()))
    start = 0
    for fam in FAMILIES:
        z = (np.arange(fam.n) + 1.0) ** -fam.zipf
        p[start:start + fam.n] = fam.weight * z / z.sum()
        start += fam.n
    return p / p.sum()


def sample_pretrain(seed: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(concept ids, style ids) of pretraining images ``index``."""
    cdf = np.cumsum(pretrain_concept_p())
    c = np.minimum(np.searchsorted(cdf, uniform(seed, index, 1) * cdf[-1], side="right"), len(cdf) - 1)
    scdf = np.cumsum(PRETRAIN_STYLE_P)
    s = np.minimum(np.searchsorted(scdf, uniform(seed, index, 2) * scdf[-1], side="right"), len(STYLES) - 1)
    return c.astype(np.int64), s.astype(np.int64)


# ---------------------------------------------------------------------------
# Rendering (vectorised over a batch)
# ---------------------------------------------------------------------------

_YY, _XX = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) + 0.5


def _pixel_u(seed: int, index: np.ndarray, stream: int) -> np.ndarray:
    n = IMAGE_SIZE * IMAGE_SIZE
    u = uniform(seed, (index[:, None] * n + np.arange(n)[None]).ravel(), stream)
    return u.reshape(len(index), IMAGE_SIZE, IMAGE_SIZE).astype(np.float32)


def _object(P: np.ndarray, U, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Objects: (image [B,H,W,3] over a random background, mask [B,H,W])."""
    cx = 16 + (U(20) - 0.5) * 8
    cy = 16 + (U(21) - 0.5) * 8
    r = (7.5 + 3.5 * P[:, 15]) * (0.85 + 0.3 * U(22)) * scale
    rot = (U(23) - 0.5) * 0.8
    aspect = 0.7 + 0.6 * P[:, 7]
    dx = (_XX[None] - cx[:, None, None]) / r[:, None, None]
    dy = (_YY[None] - cy[:, None, None]) / r[:, None, None]
    c, s = np.cos(rot)[:, None, None], np.sin(rot)[:, None, None]
    u, v = c * dx + s * dy, (-s * dx + c * dy) / aspect[:, None, None]
    rho, th = np.sqrt(u * u + v * v), np.arctan2(v, u)
    edge = np.ones_like(rho)
    for j, k in enumerate((2, 3, 4, 5)):  # radial harmonics: the silhouette
        amp = (P[:, j] ** 2 * 0.35)[:, None, None]
        edge = edge + amp * np.cos(k * th + 2 * math.pi * P[:, 4 + (j % 3)][:, None, None])
    mask = rho <= edge
    # a part: a small disc on the rim at a concept-specific angle (a head, a wing, a tail fin)
    pa = 2 * math.pi * P[:, 6]
    px, py = np.cos(pa) * 1.05, np.sin(pa) * 1.05
    part = ((u - px[:, None, None]) ** 2 + (v - py[:, None, None]) ** 2) <= (0.2 + 0.3 * P[:, 5])[:, None, None] ** 2
    mask = mask | part
    main = _palette(P[:, 8:11]) * (0.85 + 0.3 * U(24))[:, None] + (np.stack([U(25), U(26), U(27)], 1) - 0.5) * 30
    second = _palette(P[:, 11:14])
    # fill texture in object coordinates
    fill = np.minimum((P[:, 14] * 4).astype(int), 3)
    freq = (2.5 + 3 * P[:, 12])[:, None, None]
    stripes = np.sin(freq * 3 * (u + v)) > 0
    dots = (np.sin(freq * 3 * u) * np.sin(freq * 3 * v)) > 0.5
    rings = np.sin(freq * 4 * rho) > 0.3
    pattern = np.stack([np.zeros_like(stripes), stripes, dots, rings], 1)
    pat = np.take_along_axis(pattern, fill[:, None, None, None], 1)[:, 0]
    obj = np.where(pat[..., None], second[:, None, None, :], main[:, None, None, :])
    obj = np.where(part[..., None] & ~(rho <= edge)[..., None], second[:, None, None, :] * 0.7, obj)
    # background: a random dull colour with a gradient
    bg = _palette(np.stack([U(28), U(29) * 0.5, U(30) * 0.6], 1))
    grad = (_YY[None] / IMAGE_SIZE - 0.5) * ((U(31) - 0.5) * 80)[:, None, None]
    img = bg[:, None, None, :] + grad[..., None]
    img = np.where(mask[..., None], obj, img)
    return img.astype(np.float32), mask


def _texture(P: np.ndarray, U) -> np.ndarray:
    """Textures (the world's DTD): two oriented waves, thresholded or smooth, in two colours."""
    a1 = math.pi * (P[:, 0] + (U(20) - 0.5) * 0.3)
    a2 = math.pi * (P[:, 1] + (U(25) - 0.5) * 0.3)
    zoom = 0.7 + 0.6 * U(21)  # the same texture seen nearer or farther
    f1 = (0.3 + 1.2 * P[:, 2]) * zoom
    f2 = (0.3 + 1.2 * P[:, 3]) * zoom
    ph1, ph2 = U(22) * 2 * math.pi, U(23) * 2 * math.pi
    X, Y = _XX[None], _YY[None]
    w1 = np.sin(f1[:, None, None] * (np.cos(a1)[:, None, None] * X + np.sin(a1)[:, None, None] * Y) + ph1[:, None, None])
    w2 = np.sin(f2[:, None, None] * (np.cos(a2)[:, None, None] * X + np.sin(a2)[:, None, None] * Y) + ph2[:, None, None])
    mix = P[:, 4][:, None, None]
    t = w1 + (2 * mix - 0.5) * w2
    hard = P[:, 5] > 0.5
    t = np.where(hard[:, None, None], (t > 0).astype(np.float32), (t - t.min()) / (np.ptp(t) + 1e-6))
    jitter = lambda s: (np.stack([U(s), U(s + 1), U(s + 2)], 1) - 0.5) * 70  # noqa: E731
    c1 = _palette(P[:, 8:11]) * (0.7 + 0.6 * U(24))[:, None] + jitter(26)
    c2 = _palette(P[:, 11:14]) * (0.7 + 0.6 * U(29))[:, None] + jitter(30)
    light = (_XX[None] / IMAGE_SIZE - 0.5) * ((U(33) - 0.5) * 100)[:, None, None]
    return (c1[:, None, None, :] * t[..., None] + c2[:, None, None, :] * (1 - t[..., None])
            + light[..., None]).astype(np.float32)


def _scene(P: np.ndarray, U) -> np.ndarray:
    """Scenes (the world's SUN397): sky, ground at a horizon, and a row of concept-specific elements."""
    X, Y = _XX[None], _YY[None]
    horizon = (8 + 16 * P[:, 0] + (U(20) - 0.5) * 10)[:, None, None]
    jitter = lambda s: (np.stack([U(s), U(s + 1), U(s + 2)], 1) - 0.5) * 70  # noqa: E731
    sky = (_palette(P[:, 8:11] * np.array([1, 0.6, 1])) + jitter(30))[:, None, None, :]
    ground = (_palette(P[:, 11:14]) + jitter(33))[:, None, None, :]
    img = np.where((Y < horizon)[..., None], sky * (0.8 + 0.4 * (Y / 32))[..., None], ground)
    # elements: n vertical blocks (buildings, trees) of a concept-specific height, width, shape and colour
    n = np.maximum(1, (P[:, 1] * 5 + (U(36) - 0.5) * 2.5).round().astype(int))
    w = (1.5 + 3 * P[:, 2]) * (0.7 + 0.6 * U(37))
    h = (3 + 12 * P[:, 3]) * (0.6 + 0.8 * U(38))
    pointy = P[:, 4] > 0.5
    ecol = (_palette(np.stack([P[:, 5], P[:, 6], 0.3 + 0.5 * P[:, 7]], 1)) + jitter(39))[:, None, None, :]
    shift = U(21) * 32
    spacing = 32.0 / n
    xm = (X + shift[:, None, None]) % spacing[:, None, None] - spacing[:, None, None] / 2
    top = horizon - h[:, None, None] * (1 - np.where(pointy[:, None, None], np.abs(xm) / w[:, None, None], 0))
    el = (np.abs(xm) <= w[:, None, None]) & (Y >= top) & (Y <= horizon + 1)
    img = np.where(el[..., None], ecol, img)
    return img.astype(np.float32)


def _land(P: np.ndarray, U, seed: int, index: np.ndarray) -> np.ndarray:
    """Land seen from above (the world's EuroSAT): fields, forest, water, roads, in a concept's pattern."""
    X, Y = _XX[None], _YY[None]
    ang = 2 * math.pi * U(20)
    c, s = np.cos(ang)[:, None, None], np.sin(ang)[:, None, None]
    xr, yr = c * X + s * Y, -s * X + c * Y
    period = ((3 + 10 * P[:, 0]) * (0.6 + 0.8 * U(21)))[:, None, None]
    strip = np.sin(2 * math.pi * xr / period) > (P[:, 1] * 1.6 - 0.8 + (U(22) - 0.5) * 0.8)[:, None, None]
    noise = _pixel_u(seed, index, 40)
    blotch = noise < (P[:, 2] * (0.5 + U(23)))[:, None, None]
    road = (np.abs((yr + 40) % (8 + 16 * P[:, 3])[:, None, None]) < 1.2) & (P[:, 4] > 0.5)[:, None, None]
    c1 = _palette(np.stack([0.15 + 0.5 * P[:, 5], 0.3 + 0.4 * P[:, 6], 0.2 + 0.4 * P[:, 7]], 1))[:, None, None, :]
    c2 = _palette(np.stack([0.15 + 0.5 * P[:, 8], 0.3 + 0.4 * P[:, 9], 0.2 + 0.4 * P[:, 10]], 1))[:, None, None, :]
    jitter = lambda s: (np.stack([U(s), U(s + 1), U(s + 2)], 1) - 0.5) * 80  # noqa: E731
    img = np.where((strip ^ blotch)[..., None], c1 + jitter(24)[:, None, None, :], c2 + jitter(27)[:, None, None, :])
    img = np.where(road[..., None], np.float32(170.0), img)
    haze = U(30)[:, None, None, None] * 0.6  # clouds and haze: a satellite image's own rendering shift
    img = img * (1 - haze) + 180 * haze
    return img.astype(np.float32)


def _edges(img: np.ndarray) -> np.ndarray:
    """Edge strength of a batch [B,H,W,3] -> [B,H,W] (luminance gradient magnitude)."""
    lum = img.mean(-1)
    gx = np.zeros_like(lum)
    gy = np.zeros_like(lum)
    gx[:, :, 1:-1] = lum[:, :, 2:] - lum[:, :, :-2]
    gy[:, 1:-1, :] = lum[:, 2:, :] - lum[:, :-2, :]
    return np.sqrt(gx * gx + gy * gy)


def render(concepts: np.ndarray, styles: np.ndarray, seed: int, index: np.ndarray,
           difficulty: float = 0.0) -> np.ndarray:
    """Images of concepts ``concepts`` in ``styles`` (ids into ``STYLES``): uint8 [B, 32, 32, 3].

    ``difficulty`` in [0, 1] adds clutter (random blobs) and lowers contrast: what a task may add on top of a
    style (the world's ImageNet-V2 is the source at difficulty 0.35)."""
    cat = catalogue()
    concepts = np.asarray(concepts, dtype=np.int64)
    styles = np.asarray(styles, dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    B = len(index)
    P = np.array([cat[c].params for c in concepts], dtype=np.float32).reshape(B, N_PARAMS)
    kinds = np.array([FAMILIES[FAMILY_INDEX[cat[c].family]].kind for c in concepts])
    U = lambda stream: uniform(seed, index, stream).astype(np.float32)  # noqa: E731
    img = np.zeros((B, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32)
    hard = styles == STYLES.index("hard")
    scale = np.where(hard, 0.85, 1.0).astype(np.float32)  # 0.6 left too few pixels to tell 100 classes apart
    for kind in ("object", "texture", "scene", "land"):
        sel = np.nonzero(kinds == kind)[0]
        if len(sel) == 0:
            continue
        Us = lambda stream, sel=sel: U(stream)[sel]  # noqa: E731
        if kind == "object":
            img[sel] = _object(P[sel], Us, scale[sel])[0]
        elif kind == "texture":
            img[sel] = _texture(P[sel], Us)
        elif kind == "scene":
            img[sel] = _scene(P[sel], Us)
        else:
            img[sel] = _land(P[sel], Us, seed, index[sel])
    if difficulty > 0:  # clutter: a few random blobs, lower contrast
        for k in range(3):
            bx, by = U(60 + k) * 32, U(63 + k) * 32
            br = 2 + 4 * U(66 + k) * difficulty
            blob = ((_XX[None] - bx[:, None, None]) ** 2 + (_YY[None] - by[:, None, None]) ** 2) <= (br ** 2)[:, None, None]
            on = (U(69 + k) < difficulty)[:, None, None]
            col = _palette(np.stack([U(72 + k), U(75 + k), U(78 + k)], 1))[:, None, None, :]
            img = np.where((blob & on)[..., None], col, img)
        img = 128 + (img - 128) * (1 - 0.4 * difficulty)
    # styles
    if np.any(styles > 0):
        edges = _edges(img)
        # cartoon: colours posterised to 6 levels a channel, dark outlines (ImageNet-R keeps CLIP's accuracy;
        # 4 levels merged the colours that tell fine-grained concepts apart)
        cartoon = np.round(img / 51.0) * 51.0
        cartoon = np.where((edges > 40)[..., None], np.float32(20.0), cartoon)
        # sketch: strokes on paper in a darkened, partly desaturated pencil of the object's colour (grey strokes left
        # 200 concepts told apart by shape alone: near chance, where ImageNet-Sketch keeps ~70% of CLIP's top-1)
        paper = 200 + 40 * _pixel_u(seed, index, 41)[..., None]
        pencil = 0.7 * (0.7 * img + 0.3 * img.mean(-1, keepdims=True)) + 15 * _pixel_u(seed, index, 42)[..., None]
        sketch = np.where((edges > 15)[..., None], pencil, paper)
        # hard: occluding bar, low contrast
        bx = U(50) * 32
        bar = np.abs(_XX[None] - bx[:, None, None]) < 2.5
        dark = 128 + (img - 128) * 0.8 - 10
        dark = np.where(bar[..., None], np.float32(60.0), dark)
        st = styles[:, None, None, None]
        img = np.where(st == 1, cartoon, np.where(st == 2, sketch, np.where(st == 3, dark, img)))
    grain = (_pixel_u(seed, index, 43) - 0.5)[..., None] * 20
    img = np.clip(img + grain, 0, 255).astype(np.uint8)
    # Half the world faces the other way: a concept is seen mirrored as often as not, as real objects are (without
    # this, a flipped training view, as CoOp's augmentation makes, looked like another concept to the towers).
    mirror = U(90) < 0.5
    img[mirror] = img[mirror][:, :, ::-1]
    return img


# ---------------------------------------------------------------------------
# Captions
# ---------------------------------------------------------------------------


def _pick(options: Sequence[str], u: float) -> str:
    return options[min(int(u * len(options)), len(options) - 1)]


# Words that describe what an image shows, one function of the prototype per kind: captions that do not name the
# concept (and some that do) say a few of them, so the image tower learns the visible parts and not only what
# names tell apart (an image tower that learned only the names left 16 shots little to add over zero-shot).
SHAPE_WORDS = ("round", "oblong", "trefoil", "boxy", "starry")
SIDE_WORDS = ("side", "bottom", "side", "top")  # where an object's part sits (left and right: images are mirrored)
PART_WORDS = ("knob", "fin")  # a small or a large part
# What alt-text puts before the subject: up to 14 of these open a caption, so a prompt's context (CoOp's learned
# vectors start at random) is something the text tower has learned to read past, as real CLIP's has.
FILLER_WORDS = ("my", "our", "nice", "old", "new", "look", "at", "here", "is", "very", "cool", "best", "great",
                "lovely", "shot", "pic", "today", "seen", "in", "on", "the", "one", "some", "day", "free", "stock",
                "close", "up", "high", "quality", "art", "view", "and", "just", "little", "big", "real", "good",
                "cute", "rare")


MAX_CAPTION_WORDS = 21  # with a comma token, start and end: within the 24-token context


@cache
def describe(con: Concept) -> tuple[tuple[str, ...], ...]:
    """Attribute phrases a caption may say of concept ``con`` (each a tuple of words, in a fixed order); a pure
    function of the concept, computed once (captions ask for it for every image)."""
    p = con.params
    fam = FAMILIES[FAMILY_INDEX[con.family]]
    second = _nearest_colour(_palette(np.array(p[11:14])))
    if fam.kind == "object":
        amps = [p[j] ** 2 * 0.35 for j in range(4)]
        shape = SHAPE_WORDS[0] if max(amps) < 0.08 else SHAPE_WORDS[1 + int(np.argmax(amps))]
        side = SIDE_WORDS[int(((p[6] + 0.125) % 1.0) * 4) % 4]
        out = [[shape], ["tall" if p[7] > 0.6 else "flat" if p[7] < 0.4 else "even"],
               ["big" if p[15] > 0.5 else "small"],
               ["with", "a", side, PART_WORDS[int(p[5] > 0.5)]]]
        if con.fill != "plain":
            out.append(["with", second, {"striped": "stripes", "dotted": "dots", "ringed": "rings"}[con.fill]])
    elif fam.kind == "texture":
        ang = int(((p[0] + 0.125) % 1.0) * 4) % 4
        out = [[("horizontal", "diagonal", "vertical", "diagonal")[ang]], ["fine" if p[2] > 0.5 else "coarse"],
               ["sharp" if p[5] > 0.5 else "soft"], ["and", second]]
    elif fam.kind == "scene":
        out = [["with", "few" if p[1] < 0.4 else "many", "tall" if p[3] > 0.5 else "low",
                "pointy" if p[4] > 0.5 else "flat", "blocks"],
               ["with", "a", "high" if p[0] > 0.5 else "low", "horizon"], ["and", second, "ground"]]
    else:
        out = [["with", "roads"] if p[4] > 0.5 else ["without", "roads"], ["fine" if p[0] < 0.4 else "coarse"],
               ["patchy" if p[2] > 0.5 else "plain"]]
    return tuple(tuple(ph) for ph in out)


def captions(concepts: np.ndarray, styles: np.ndarray, seed: int, index: np.ndarray) -> list[str]:
    """Pretraining captions: 1-14 filler words (40% of captions), an opener (the family's own with its
    ``opener_p`` in photos, else the style's), some attribute words and the concept's name (with its family's
    ``name_p``; else the family word; a ``confuse_p`` share of those names are the confuser's, see ``confusers``),
    and sometimes ", a kind of <family word>"; at most ``MAX_CAPTION_WORDS``.

    Attributes: the main colour (half the time, objects and textures), the fill of objects (a third), and each
    of ``describe``'s phrases with probability 0.5 when the name is not said and 0.15 when it is."""
    cat = catalogue()
    idx = np.asarray(index, dtype=np.int64)
    us = {k: uniform(seed, idx, 300 + i) for i, k in enumerate(
        ["name", "colour", "fill", "opener", "kind", "form", "nfill", "desc", "fopener"])}
    fill_u = [uniform(seed, idx, 340 + j) for j in range(14)]
    desc_u = [uniform(seed, idx, 330 + j) for j in range(5)]
    confuse_u = uniform(seed, idx, 399)
    confuser = confusers()
    out = []
    for i, (c, s) in enumerate(zip(concepts, styles)):
        con = cat[int(c)]
        fam = FAMILIES[FAMILY_INDEX[con.family]]
        g = {k: float(v[i]) for k, v in us.items()}
        named = g["name"] < fam.name_p
        # 40% of captions open with 1-14 filler words, so a name is read at any position up to the context's
        # end, as CoOp's prompts put it (16 context vectors, then the name: position 17)
        n_fill = 1 + min(int(g["nfill"] / 0.4 * 14), 13) if g["nfill"] < 0.4 else 0
        fillers = [_pick(FILLER_WORDS, float(fill_u[j][i])) for j in range(n_fill)]
        adj = []
        if g["colour"] < 0.5 and fam.kind in ("object", "texture"):
            adj.append(con.colour)
        if fam.kind == "object" and g["fill"] < 0.33:
            adj.append(con.fill)
        p_desc = 0.15 if named else 0.5
        phrases = [ph for j, ph in enumerate(describe(con)) if float(desc_u[j][i]) < p_desc]
        adj += [w for ph in phrases if len(ph) == 1 for w in ph]  # one-word attributes go before the noun
        after = [w for ph in phrases if len(ph) > 1 for w in ph]
        noun = (cat[confuser[con.id]].name if confuse_u[i] < fam.confuse_p else con.name) if named else fam.word
        tail = [",", "a", "kind", "of", fam.word] if named and g["kind"] < 0.4 else \
            ["texture"] if fam.kind == "texture" and g["form"] < 0.5 else []
        if STYLES[int(s)] == "photo" and g["fopener"] < fam.opener_p:
            opener = _pick(fam.openers, g["opener"])
        else:
            opener = _pick(STYLE_OPENERS[STYLES[int(s)]], g["opener"])
        words = [opener] + adj + [noun] + after + tail
        words = fillers[:max(0, MAX_CAPTION_WORDS - len(words))] + words
        text = " ".join(words).replace(" ,", ",").split()[:MAX_CAPTION_WORDS]
        for j in range(len(text) - 1):
            if text[j] == "a" and text[j + 1][0] in "aeiou":
                text[j] = "an"
        out.append(" ".join(text))
    return out


def vocabulary() -> list[str]:
    """Every word world 2's captions, class names and task templates use (the word tokenizer's vocabulary)."""
    words = set()
    for opts in STYLE_OPENERS.values():
        for o in opts:
            words.update(o.split())
    words.update(COLOUR_WORDS)
    words.update(FILLS)
    words.update(FILLER_WORDS)
    for fam in FAMILIES:
        for o in fam.openers:
            words.update(o.split())
    for con in catalogue():
        for ph in describe(con):
            words.update(ph)
    words.update(f.word for f in FAMILIES)
    words.update(c.name for c in catalogue())
    # words of the tasks' templates (world2tasks)
    words.update("a an the of kind type texture photo place satellite view from above pattern art".split())
    return sorted(words)


def render_pretrain(seed: int, index: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """A pretraining batch: images uint8 [B,32,32,3] and captions."""
    index = np.asarray(index, dtype=np.int64)
    c, s = sample_pretrain(seed, index)
    return render(c, s, seed, index), captions(c, s, seed, index)
