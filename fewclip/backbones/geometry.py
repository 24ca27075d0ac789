"""Embedding geometries: where CLIP-family embeddings live and how they are compared.

A geometry answers three questions for a dual-encoder model:

1. how a raw tower output becomes a point of the geometry (``embed_image``,
   ``embed_text``),
2. how several prompt-template embeddings of one class average into a class
   prototype (``prototype``),
3. how image points and prototypes turn into similarities and logits
   (``similarity``, ``logits``), with a logit scale and, for the sigmoid
   geometry, a bias;

and owns its *linear space*, where linear models and averages live
(``to_linear``, ``from_linear``): R^D itself for the Euclidean geometries,
the ambient R^D of the sphere for the spherical ones (``from_linear``
normalises), the tangent space at the origin for the hyperboloid (log and exp
maps). ``image_logits`` is the one "embed the image features, then compare
with the class points" every classifier uses.

The math is written twice on purpose: as pure tensor functions that a test can
call with a few numbers, and as one small ``nn.Module`` per geometry that owns
the parameters (logit scale, bias, curvature, per-modality scales). The
modules serve frozen backbones (fixed parameters) and contrastive pretraining
(``learnable=True``) alike.

Geometries (``GEOMETRIES``):

===============  ===========================================  ==============
name             similarity                                   default scale
===============  ===========================================  ==============
clip             cosine (OpenAI CLIP, open_clip)              100
elliptic         minus the great-circle angle                 100
sigmoid          cosine, logits get a bias (SigLIP)           10 (bias -10)
euclidean        minus Euclidean distance (EuCLIP)            10
euclidean_sq     minus squared Euclidean distance             10
hyperbolic       minus Lorentz geodesic distance (MERU)       10
hyperbolic_sq    minus squared Lorentz distance               10
===============  ===========================================  ==============

The default logit scales are starting points for pretraining only; a frozen
backbone's card supplies the values it was trained with.

Lorentz points are stored by their space components only, as in MERU (Desai et
al., 2023): a point ``x`` in ``R^D`` stands for ``(t, x)`` on the hyperboloid
``t^2 - ||x||^2 = 1/c`` with ``t = sqrt(1/c + ||x||^2)``; the curvature is
``-c``.

Geometry methods run in float32 (or wider) with autocast switched off: acosh
and arccos near 1 and the exponential map lose all precision in float16 and
bfloat16 (MERU does the same). Outputs are therefore float32 for half inputs.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.utils.registry import Registry

_SINH_INPUT_MAX = math.asinh(2**15)  # MERU: keeps exp_map0 finite in float32
_LOG_SCALE_MAX = math.log(100.0)  # CLIP and MERU cap the learned logit scale at 100
_ARCCOS_MARGIN = 1e-7  # elliptic: keep arccos off +-1, where its slope is infinite


# -----------------------------------------------------------------------------
# pure tensor functions


def _as_tensor(value: float | Tensor, like: Tensor) -> Tensor:
    """A Python number or a (possibly learnable) 0-dim tensor, in ``like``'s dtype."""
    if isinstance(value, Tensor):
        return value.to(dtype=like.dtype, device=like.device)
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)


def _clamped_norm(x: Tensor, eps: float) -> Tensor:
    """``max(||x||, eps)`` over the last dim, kept: [..., 1].

    ``vector_norm`` has gradient 0 at the zero vector and the clamp blocks the
    gradient below ``eps``, so nothing here is NaN at the origin.
    """
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def l2_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Unit vectors along the last dim; the zero vector maps to zero with finite gradient."""
    return x / _clamped_norm(x, eps)


def cosine_matrix(x: Tensor, y: Tensor) -> Tensor:
    """Cosine similarity of already-normalised rows: [B, D] x [C, D] -> [B, C]."""
    B, D = x.shape
    C, _ = y.shape
    return x @ y.T


def euclidean_distance(x: Tensor, y: Tensor, squared: bool = False) -> Tensor:
    """Pairwise Euclidean distance: [B, D] x [C, D] -> [B, C].

    Uses ``torch.cdist`` with ``compute_mode="donot_use_mm_for_euclid_dist"``:
    it sums ``(x_i - y_j)^2`` directly, so it is as accurate as the broadcast
    difference ``(x[:, None] - y[None]).pow(2).sum(-1)`` (no cancellation from
    ``||x||^2 + ||y||^2 - 2 x.y``, which is not even zero at ``x == y``) while
    never holding the [B, C, D] difference tensor in memory. Its gradient is
    defined as 0 where the distance is exactly 0, so ``x == y`` gives a finite
    gradient for both the plain and the squared distance (whose true gradient
    there is 0 anyway).
    """
    B, D = x.shape
    C, _ = y.shape
    dist = torch.cdist(x, y, p=2.0, compute_mode="donot_use_mm_for_euclid_dist")
    return dist.pow(2) if squared else dist


def lorentz_time(x: Tensor, curv: float | Tensor) -> Tensor:
    """Time component ``sqrt(1/c + ||x||^2)`` of Lorentz points given by space parts: [..., D] -> [...]."""
    c = _as_tensor(curv, x)
    return torch.sqrt(1.0 / c + x.pow(2).sum(-1))


def lorentz_inner(x: Tensor, y: Tensor, curv: float | Tensor) -> Tensor:
    """Lorentzian inner product ``x.y - t_x t_y``: [B, D] x [C, D] -> [B, C]; ``<x, x>_L = -1/c``."""
    B, D = x.shape
    C, _ = y.shape
    t_x = lorentz_time(x, curv)  # [B]
    t_y = lorentz_time(y, curv)  # [C]
    return x @ y.T - t_x[:, None] * t_y[None, :]


def lorentz_distance(x: Tensor, y: Tensor, curv: float | Tensor, eps: float = 1e-8) -> Tensor:
    """Geodesic distance on the hyperboloid: [B, D] x [C, D] -> [B, C].

    MERU's ``acosh(max(-c <x, y>_L, 1 + eps)) / sqrt(c)``, computed so that
    float32 keeps nearby points apart:

    - ``u = -c <x, y>_L - 1`` is written as ``c/2 <x - y, x - y>_L`` =
      ``c/2 (||x - y||^2 - (t_x - t_y)^2)`` with ``t_x - t_y =
      (||x||^2 - ||y||^2) / (t_x + t_y)``. The direct form subtracts two
      numbers of size ``c t_x t_y``, so in float32 a point's distance to itself
      came out ~3e-4 ||x|| instead of ~0; this form is exactly 0 at ``x == y``
      and its rounding error scales with the distance, not with the norms.
    - the clamp is applied to ``u >= eps`` and acosh is written as
      ``acosh(1 + u) = log1p(u + sqrt(u) sqrt(u + 2))``: the same value as
      clamping at ``1 + eps``, but ``1 + 1e-8`` rounds to 1 in float32, where
      acosh has infinite slope. The distance of a point to itself is
      ``~sqrt(2 eps) / sqrt(c)`` with a finite gradient.
    """
    B, D = x.shape
    C, _ = y.shape
    c = _as_tensor(curv, x)
    t_x, t_y = lorentz_time(x, c), lorentz_time(y, c)  # [B], [C]
    sq_x, sq_y = x.pow(2).sum(-1), y.pow(2).sum(-1)  # [B], [C]
    dt = (sq_x[:, None] - sq_y[None, :]) / (t_x[:, None] + t_y[None, :])  # t_x - t_y: [B, C]
    u = (c / 2 * (euclidean_distance(x, y, squared=True) - dt.pow(2))).clamp_min(eps)  # [B, C]
    return torch.log1p(u + torch.sqrt(u) * torch.sqrt(u + 2.0)) / torch.sqrt(c)


def exp_map0(v: Tensor, curv: float | Tensor, eps: float = 1e-8, clamp: bool = True) -> Tensor:
    """Exponential map at the hyperboloid origin; tangent vector [..., D] -> space part [..., D].

    ``sinh(r) v / r`` with ``r = sqrt(c) ||v||``, clamped as in MERU: ``r``
    at least ``eps`` (the zero vector maps to zero, Jacobian ~identity) and,
    with ``clamp``, ``sinh``'s input at most ``asinh(2^15)`` (huge inputs stay
    finite). EuCLIP's exponential map has no such cap (``clamp=False``).
    """
    c = _as_tensor(curv, v)
    r = _clamped_norm(torch.sqrt(c) * v, eps)  # [..., 1]
    return torch.sinh(r.clamp_max(_SINH_INPUT_MAX) if clamp else r) * v / r


def log_map0(x: Tensor, curv: float | Tensor, eps: float = 1e-8) -> Tensor:
    """Logarithmic map at the origin, inverse of ``exp_map0``: space part [..., D] -> tangent [..., D].

    The geodesic distance to the origin is ``acosh(sqrt(c) t) = acosh(sqrt(1 +
    c ||x||^2))``; it is computed as the equal ``asinh(sqrt(c) ||x||)``, which
    has no cancellation near the origin (MERU's ``acosh(max(., 1 + eps))``
    returns ``sqrt(2 eps)`` for every ``||x|| < ~1e-4`` and so scales tiny
    points up by orders of magnitude). With ``s = max(sqrt(c) ||x||, eps)``
    the result is ``asinh(s) x / s``: zero maps to zero with finite gradient.
    """
    c = _as_tensor(curv, x)
    s = _clamped_norm(torch.sqrt(c) * x, eps)  # [..., 1]
    return torch.asinh(s) * x / s


# -----------------------------------------------------------------------------
# geometry modules

# A package adds a geometry through the entry point group ``fewclip.geometries`` (fewclip.utils.registry).
GEOMETRIES: Registry[type[Geometry]] = Registry("geometry", "fewclip.geometries", key="backbone.geometry",
                                                  listing="fewclip backbones")


def register_geometry(cls: type[Geometry]) -> type[Geometry]:
    """Class decorator: add ``cls`` to ``GEOMETRIES`` under ``cls.name``."""
    GEOMETRIES.register(cls.name, cls)
    return cls


def _check_positive(key: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{key} must be a positive finite number, got {value}")
    return value


def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class Geometry(nn.Module):
    """Base class: a logit scale, the public API, and the symmetric InfoNCE loss.

    ``logit_scale`` is the multiplier itself (e.g. 100.0 for OpenAI CLIP); it
    is stored as its log, like CLIP, so that it can be learned. With
    ``learnable=False`` every parameter is still an ``nn.Parameter`` (with
    ``requires_grad=False``), so state-dict keys do not depend on the flag.

    Subclasses set ``name`` and ``default_logit_scale`` and implement
    ``_embed``, ``_prototype`` and ``_similarity``.
    """

    name: str = ""
    default_logit_scale: float = 10.0

    def __init__(self, logit_scale: float | None = None, learnable: bool = False):
        super().__init__()
        if logit_scale is None:
            logit_scale = self.default_logit_scale
        self.learnable = bool(learnable)
        self.log_scale = self._parameter(math.log(_check_positive("logit_scale", logit_scale)))

    def _parameter(self, value: float) -> nn.Parameter:
        return nn.Parameter(torch.tensor(float(value)), requires_grad=self.learnable)

    # -- parameters --------------------------------------------------------

    @property
    def scale(self) -> Tensor:
        """The logit multiplier ``exp(log_scale)`` (0-dim tensor, keeps its graph)."""
        return self.log_scale.exp()

    def clamp_(self) -> Geometry:
        """Keep learned parameters in range after an optimiser step: scale at most 100."""
        with torch.no_grad():
            self.log_scale.clamp_(max=_LOG_SCALE_MAX)
        return self

    def params(self) -> dict[str, float]:
        """Parameters as plain floats, keyed like the constructor arguments."""
        return {"logit_scale": self.scale.item()}

    def extra_repr(self) -> str:
        items = ", ".join(f"{k}={v:.6g}" for k, v in self.params().items())
        return f"{items}, learnable={self.learnable}"

    # -- public API: full precision, no autocast ---------------------------

    def embed_image(self, raw: Tensor) -> Tensor:
        """Image tower output [..., D] -> point of this geometry [..., D]."""
        with torch.autocast(raw.device.type, enabled=False):
            return self._embed(_upcast(raw), "image")

    def embed_text(self, raw: Tensor) -> Tensor:
        """Text tower output [..., D] -> point of this geometry [..., D]."""
        with torch.autocast(raw.device.type, enabled=False):
            return self._embed(_upcast(raw), "text")

    def prototype(self, emb: Tensor) -> Tensor:
        """Average T template embeddings per class: [C, T, D] -> [C, D]."""
        C, T, D = emb.shape
        with torch.autocast(emb.device.type, enabled=False):
            return self._prototype(_upcast(emb))

    def similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        """Similarity of embedded images to prototypes: [B, D] x [C, D] -> [B, C]."""
        with torch.autocast(img.device.type, enabled=False):
            return self._similarity(_upcast(img), _upcast(proto))

    def logits(self, img: Tensor, proto: Tensor) -> Tensor:
        """``scale * similarity``: [B, D] x [C, D] -> [B, C]."""
        return self.scale * self.similarity(img, proto)

    def image_logits(self, raw: Tensor, proto: Tensor) -> Tensor:
        """Raw image-tower features [B, D] against class points [C, D] -> logits [B, C]: embed, then compare."""
        return self.logits(self.embed_image(raw.to(proto.device)), proto)

    def to_linear(self, points: Tensor) -> Tensor:
        """Points of this geometry [..., D] -> coordinates in its linear space [..., D] (see the module doc)."""
        with torch.autocast(points.device.type, enabled=False):
            return self._to_linear(_upcast(points))

    def from_linear(self, v: Tensor) -> Tensor:
        """Vectors of the linear space [..., D] -> points of this geometry [..., D]; inverse of ``to_linear``
        on the points (for the sphere, a projection of any other vector)."""
        with torch.autocast(v.device.type, enabled=False):
            return self._from_linear(_upcast(v))

    def contrastive_loss(self, img_emb: Tensor, txt_emb: Tensor) -> Tensor:
        """Symmetric InfoNCE over a batch of matched pairs: [B, D] x [B, D] -> scalar.

        Row i of ``logits(img, txt)`` scores image i against every text, and
        row i of ``logits(txt, img)`` text i against every image (for these
        symmetric similarities, the transpose).
        """
        B, D = img_emb.shape
        target = torch.arange(B, device=img_emb.device)
        loss_img = F.cross_entropy(self.logits(img_emb, txt_emb), target)
        loss_txt = F.cross_entropy(self.logits(txt_emb, img_emb), target)
        return (loss_img + loss_txt) / 2

    # -- geometry-specific math --------------------------------------------

    def _embed(self, raw: Tensor, modality: str) -> Tensor:
        raise NotImplementedError

    def _prototype(self, emb: Tensor) -> Tensor:
        raise NotImplementedError

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        raise NotImplementedError

    def _to_linear(self, points: Tensor) -> Tensor:
        raise NotImplementedError(f"geometry {self.name!r} does not define its linear space (_to_linear, _from_linear)")

    def _from_linear(self, v: Tensor) -> Tensor:
        raise NotImplementedError(f"geometry {self.name!r} does not define its linear space (_to_linear, _from_linear)")


class _Spherical(Geometry):
    """Points on the unit sphere; prototypes are the renormalised mean direction."""

    def _embed(self, raw: Tensor, modality: str) -> Tensor:
        return l2_normalize(raw)

    def _prototype(self, emb: Tensor) -> Tensor:
        return l2_normalize(l2_normalize(emb).mean(dim=1))  # [C, T, D] -> [C, D]

    def _to_linear(self, points: Tensor) -> Tensor:
        return points  # unit vectors are their own coordinates in the ambient R^D

    def _from_linear(self, v: Tensor) -> Tensor:
        return l2_normalize(v)  # the direction of v: projection onto the sphere


@register_geometry
class CLIPGeometry(_Spherical):
    """Cosine similarity of unit vectors (OpenAI CLIP, open_clip)."""

    name = "clip"
    default_logit_scale = 100.0

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        return cosine_matrix(img, proto)


@register_geometry
class EllipticGeometry(_Spherical):
    """Minus the angle between unit vectors, ``-arccos(cos)`` (Chou et al., 2024)."""

    name = "elliptic"
    default_logit_scale = 100.0

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        cos = cosine_matrix(img, proto).clamp(-1 + _ARCCOS_MARGIN, 1 - _ARCCOS_MARGIN)
        return -torch.arccos(cos)


@register_geometry
class SigmoidGeometry(_Spherical):
    """Cosine similarity with a logit bias and the pairwise sigmoid loss (SigLIP)."""

    name = "sigmoid"
    default_logit_scale = 10.0

    def __init__(self, logit_scale: float | None = None, logit_bias: float = -10.0, learnable: bool = False):
        super().__init__(logit_scale=logit_scale, learnable=learnable)
        if not math.isfinite(float(logit_bias)):
            raise ValueError(f"logit_bias must be finite, got {logit_bias}")
        self.logit_bias = self._parameter(logit_bias)

    @property
    def bias(self) -> Tensor:
        return self.logit_bias

    def params(self) -> dict[str, float]:
        return {**super().params(), "logit_bias": self.logit_bias.item()}

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        return cosine_matrix(img, proto)

    def logits(self, img: Tensor, proto: Tensor) -> Tensor:
        """``scale * cosine + bias``: [B, D] x [C, D] -> [B, C]."""
        return super().logits(img, proto) + self.bias

    def contrastive_loss(self, img_emb: Tensor, txt_emb: Tensor) -> Tensor:
        """SigLIP: ``-sum over all B*B pairs of logsigmoid(label * logit) / B``, label +1 on the diagonal, -1 off it."""
        B, D = img_emb.shape
        logits = self.logits(img_emb, txt_emb)  # [B, B]
        labels = 2 * torch.eye(B, device=logits.device, dtype=logits.dtype) - 1
        return -F.logsigmoid(labels * logits).sum() / B


@register_geometry
class EuclideanGeometry(Geometry):
    """Minus Euclidean distance between unnormalised points (EuCLIP, Chou et al., 2024).

    Tower outputs are divided by ``sqrt(D)`` (no normalisation); prototypes are
    the plain mean of template embeddings.
    """

    name = "euclidean"
    default_logit_scale = 10.0
    squared = False

    def _embed(self, raw: Tensor, modality: str) -> Tensor:
        return raw / math.sqrt(raw.shape[-1])

    def _prototype(self, emb: Tensor) -> Tensor:
        return emb.mean(dim=1)  # [C, T, D] -> [C, D]

    def _to_linear(self, points: Tensor) -> Tensor:
        return points  # R^D is a vector space already

    def _from_linear(self, v: Tensor) -> Tensor:
        return v

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        return -euclidean_distance(img, proto, squared=self.squared)


@register_geometry
class EuclideanSqGeometry(EuclideanGeometry):
    """Minus squared Euclidean distance."""

    name = "euclidean_sq"
    squared = True


@register_geometry
class HyperbolicGeometry(Geometry):
    """Minus Lorentz geodesic distance on a hyperboloid of curvature ``-c`` (MERU, Desai et al., 2023).

    Tower outputs are scaled by a per-modality ``alpha`` and lifted with
    ``exp_map0``; prototypes average templates in the tangent space at the
    origin, ``exp_map0(mean(log_map0(e)))``. Curvature and alphas are stored
    as logs, like MERU.
    """

    name = "hyperbolic"
    default_logit_scale = 10.0
    squared = False

    def __init__(
        self,
        logit_scale: float | None = None,
        curvature: float = 1.0,
        alpha_image: float = 1.0,
        alpha_text: float = 1.0,
        exp_map_clamp: bool = True,
        learnable: bool = False,
    ):
        super().__init__(logit_scale=logit_scale, learnable=learnable)
        # MERU caps the exponential map's sinh input at asinh(2^15); EuCLIP (Chou et al., 2024) does not.
        self.exp_map_clamp = bool(exp_map_clamp)
        self._curvature_init = _check_positive("curvature", curvature)
        self.log_curvature = self._parameter(math.log(self._curvature_init))
        self.log_alpha_image = self._parameter(math.log(_check_positive("alpha_image", alpha_image)))
        self.log_alpha_text = self._parameter(math.log(_check_positive("alpha_text", alpha_text)))

    @property
    def curvature(self) -> Tensor:
        """``c`` of the hyperboloid ``<x, x>_L = -1/c`` (0-dim tensor)."""
        return self.log_curvature.exp()

    def clamp_(self) -> HyperbolicGeometry:
        """Scale at most 100; curvature within [init / 10, init * 10] as in MERU."""
        super().clamp_()
        with torch.no_grad():
            low, high = math.log(self._curvature_init / 10), math.log(self._curvature_init * 10)
            self.log_curvature.clamp_(min=low, max=high)
        return self

    def params(self) -> dict[str, float]:
        return {
            **super().params(),
            "curvature": self.curvature.item(),
            "alpha_image": self.log_alpha_image.exp().item(),
            "alpha_text": self.log_alpha_text.exp().item(),
            **({} if self.exp_map_clamp else {"exp_map_clamp": False}),
        }

    def _embed(self, raw: Tensor, modality: str) -> Tensor:
        log_alpha = self.log_alpha_image if modality == "image" else self.log_alpha_text
        return exp_map0(log_alpha.exp() * raw, self.curvature, clamp=self.exp_map_clamp)

    def _prototype(self, emb: Tensor) -> Tensor:
        # The mean of the templates' tangent vectors at the origin (log_map0 of each embedded point), lifted back.
        # MERU's zero-shot evaluator lifts alpha * (the mean of the raw text features) instead: the same wherever
        # exp_map0 is inverted by log_map0, i.e. sqrt(c) * alpha * |x| <= asinh(2^15) (about 11.09) for every
        # template. Beyond that MERU's cap puts a template at the cap's point, and fewclip averages that point (the
        # one the model uses for the template alone, and the only input a prototype gets from prompt learners
        # and caches), MERU the vector beyond it (tests/test_import_weights.py::test_saturated_templates).
        c = self.curvature
        return exp_map0(log_map0(emb, c).mean(dim=1), c, clamp=self.exp_map_clamp)  # [C, T, D] -> [C, D]

    def _to_linear(self, points: Tensor) -> Tensor:
        # The hyperboloid is not a vector space; the tangent space at the origin is, and templates average there.
        return log_map0(points, self.curvature)

    def _from_linear(self, v: Tensor) -> Tensor:
        return exp_map0(v, self.curvature)

    def _similarity(self, img: Tensor, proto: Tensor) -> Tensor:
        dist = lorentz_distance(img, proto, self.curvature)
        return -dist.pow(2) if self.squared else -dist


@register_geometry
class HyperbolicSqGeometry(HyperbolicGeometry):
    """Minus squared Lorentz geodesic distance."""

    name = "hyperbolic_sq"
    squared = True


def geometry_params(name: str) -> list[str]:
    """Constructor keywords that geometry ``name`` accepts."""
    cls = _geometry_class(name)
    return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]


def _geometry_class(name: str) -> type[Geometry]:
    return GEOMETRIES.get(name)


def make_geometry(name: str, **params: Any) -> Geometry:
    """Build a registered geometry, e.g. ``make_geometry("hyperbolic", logit_scale=10.0, curvature=0.1)``.

    Unknown names and keywords the geometry does not take raise ``ValueError``
    naming them and the allowed values.
    """
    cls = _geometry_class(name)
    allowed = geometry_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"geometry {name!r} does not take {unknown}; allowed: {allowed}")
    return cls(**params)


# -----------------------------------------------------------------------------
# rules for naming a checkpoint's geometry (cards, imports, open_clip models)

GEOMETRY_ALIASES = {  # the EuCLIP fork's --geometry names (Chou et al., 2024) -> fewclip's
    "euclidean-squared": "euclidean_sq", "hyperbolic-squared": "hyperbolic_sq",
}
UNSUPPORTED_GEOMETRIES = {
    "euclidean-inner": "the inner product of unnormalised embeddings",
    "hyperbolic-inner": "the Lorentzian inner product",
}
REQUIRED_GEOMETRY_PARAMS = {
    "sigmoid": ("logit_scale", "logit_bias"),
    "hyperbolic": ("logit_scale", "curvature", "alpha_image", "alpha_text"),
    "hyperbolic_sq": ("logit_scale", "curvature", "alpha_image", "alpha_text"),
}


def canonical_geometry(name: str) -> str:
    """fewclip's geometry name for ``name``, accepting the EuCLIP fork's names (``euclidean-squared``)."""
    if name in UNSUPPORTED_GEOMETRIES:
        raise ValueError(f"geometry {name!r} ({UNSUPPORTED_GEOMETRIES[name]}) has no fewclip geometry; fewclip has "
                         f"{sorted(GEOMETRIES)} (and the aliases {sorted(GEOMETRY_ALIASES)})")
    return GEOMETRY_ALIASES.get(name, name)


def geometry_of_open_clip(has_logit_bias: bool) -> str:
    """The geometry of an open_clip model: SigLIP's sigmoid where the model has a logit bias, else CLIP's cosine."""
    return "sigmoid" if has_logit_bias else "clip"
