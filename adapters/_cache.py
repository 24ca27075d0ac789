"""Plumbing shared by the cache-based methods (Tip-Adapter, Tip-Adapter-F, TaskRes, CLAP, LP++), in any geometry.

Pure tensor functions:

* ``text_classifier``: the zero-shot prototypes of the run's templates and their *raw-space preimage*, the
  class weights in the text tower's output space that TaskRes and CLAP train (their authors' code adds the
  residual, or trains the weights, on raw template-averaged text features and normalises after).
* ``max_similarity`` and ``affinity``: Tip-Adapter's cache affinity ``exp(-beta (1 - cos))`` carried to any
  geometry as ``exp(beta (s(x, k) - s_max))``, with ``s`` the geometry's similarity and ``s_max`` its value
  for a point and itself.
* ``authors_grid`` and ``search_alpha_beta``: Tip-Adapter's (beta, alpha) grid search, on validation
  features only.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fewclip.backbones.geometry import Geometry
from fewclip.features.encode import class_text_features, prototypes_of

TIE_BREAKS = ("loss", "first")


class TextClassifier(NamedTuple):
    prototypes: Tensor  # [C, D] points of the geometry: the zero-shot classifier (fewclip.features.encode.text_prototypes)
    base: Tensor  # [C, D] raw text-tower space; geometry.embed_text(base) == prototypes


@torch.no_grad()
def text_classifier(backbone, classnames: Sequence[str], templates: Sequence[str]) -> TextClassifier:
    """The zero-shot prototypes of ``templates`` and their preimage in the text tower's output space."""
    raw = class_text_features(backbone, classnames, templates)  # [C, T, D]
    protos = prototypes_of(backbone.geometry, raw)
    return TextClassifier(protos, raw_preimage(backbone.geometry, protos, raw))


def raw_preimage(geometry: Geometry, prototypes: Tensor, raw: Tensor) -> Tensor:
    """Class weights in the text tower's output space whose text embedding is each prototype: [C, D], [C, T, D]
    -> [C, D].

    ``to_linear(prototype)`` rescaled to the norm of the class's template-averaged raw text features. For the
    Euclidean and hyperbolic geometries the embedding of a raw feature is linear in it up to the exponential
    map (``raw / sqrt(D)``, ``exp_map0(alpha_text raw)``) and prototypes average in that linear space, so this
    is the template mean of the raw features itself. For the spherical geometries the embedding forgets the
    norm: this is the prototype's direction at the raw mean's norm, which with one template is the raw text
    feature itself (TaskRes's and CLAP's "base"), and with several keeps fewclip's prototype (templates
    normalised, then averaged) so that training starts exactly at fewclip's zero-shot classifier.
    """
    C, T, D = raw.shape
    lin = geometry.to_linear(prototypes.double())  # [C, D]
    norm = raw.double().mean(dim=1).norm(dim=-1, keepdim=True)  # [C, 1]
    return (lin * norm / lin.norm(dim=-1, keepdim=True).clamp_min(1e-30)).to(prototypes.dtype)


@torch.no_grad()
def self_similarity(geometry: Geometry, dim: int) -> Tensor:
    """The geometry's similarity of a point with itself, the largest it takes, as a 0-dim float32 tensor on
    the geometry's device (read without a host sync): 1 for the cosine (clip, sigmoid), 0 (up to the clamps
    that keep gradients finite) for minus a distance or an angle."""
    device = geometry.log_scale.device
    p = geometry.embed_image(torch.eye(1, dim, device=device))  # any point gives the same value
    return geometry.similarity(p, p).reshape(())


def max_similarity(geometry: Geometry, dim: int) -> float:
    """``self_similarity`` as a Python number."""
    return float(self_similarity(geometry, dim))


def affinity(geometry: Geometry, img: Tensor, keys: Tensor, beta, s_max) -> Tensor:
    """Tip-Adapter's affinity of embedded images to cache keys: [B, D] x [N, D] -> [B, N] in (0, 1].

    ``exp(beta (s(x, k) - s_max))``: in the clip geometry ``exp(-beta (1 - cos))`` (Tip-Adapter's own); with
    minus a distance d (Euclidean, hyperbolic) ``exp(-beta d)``, a Laplacian kernel (Gaussian for the squared
    distances); for the elliptic geometry ``exp(-beta angle)``.
    """
    B, D = img.shape
    N, _ = keys.shape
    return torch.exp(beta * (geometry.similarity(img, keys) - s_max))


def authors_grid(scale: float, steps: int) -> list[float]:
    """Tip-Adapter's search grid (``utils.search_hp``): ``steps`` values from 0.1 up to, not including,
    ``scale``."""
    return [i * (scale - 0.1) / steps + 0.1 for i in range(steps)]


@torch.no_grad()
def search_alpha_beta(zs_logits: Tensor, dist: Tensor, values: Tensor, labels: Tensor, betas: Sequence[float],
                      alphas: Sequence[float], tie_break: str = "loss") -> tuple[float, float, Tensor]:
    """Tip-Adapter's hyperparameter search: the (beta, alpha) whose logits ``zs_logits + alpha exp(-beta dist)
    @ values`` score best on the given (validation) images.

    ``zs_logits`` [B, C] zero-shot logits, ``dist`` [B, N] = ``s_max - s(x, k)`` >= 0, ``values`` [N, C], labels
    [B]. Accuracy decides; among equal accuracies ``tie_break="first"`` keeps the first in beta-major order
    (the authors' strict ``>``), ``"loss"`` the lowest cross-entropy (then the first). Returns (beta, alpha,
    accuracy grid [len(betas), len(alphas)] in percent).
    """
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    B, C = zs_logits.shape
    a = torch.tensor(list(alphas), dtype=zs_logits.dtype, device=zs_logits.device)[:, None, None]  # [A, 1, 1]
    acc = torch.zeros(len(betas), len(alphas), dtype=torch.float64)
    best, best_key = (0, 0), None
    for i, beta in enumerate(betas):
        cache = torch.exp(-beta * dist) @ values  # [B, C]
        logits = zs_logits + a * cache  # [A, B, C]
        acc[i] = 100.0 * (logits.argmax(-1) == labels).double().mean(-1).cpu()
        if tie_break == "loss":
            ce = F.cross_entropy(logits.transpose(1, 2), labels.expand(len(alphas), B), reduction="none").mean(-1)
            keys = [(float(acc[i, j]), -float(ce[j])) for j in range(len(alphas))]
        else:
            keys = [(float(acc[i, j]),) for j in range(len(alphas))]
        for j, key in enumerate(keys):
            if best_key is None or key > best_key:  # strict: the first of equals stays
                best, best_key = (i, j), key
    return float(betas[best[0]]), float(alphas[best[1]]), acc


def choose(accuracies: Sequence[float], losses: Sequence[float], tie_break: str = "loss") -> int:
    """Index of the best of several candidates scored on validation: the highest accuracy; among equal
    accuracies the lowest cross-entropy (``"loss"``) or the first (``"first"``, the authors' strict ``>``)."""
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    keys = [(float(a), -float(loss)) if tie_break == "loss" else (float(a),) for a, loss in zip(accuracies, losses)]
    best = 0
    for i, key in enumerate(keys):
        if key > keys[best]:  # strict: the first of equals stays
            best = i
    return best


@torch.no_grad()
def scored(logits: Tensor, labels: Tensor) -> tuple[float, float]:
    """(accuracy in percent, mean cross-entropy) of logits [B, C] against labels [B]."""
    B, C = logits.shape
    labels = labels.to(logits.device)
    acc = 100.0 * float((logits.argmax(-1) == labels).double().mean())
    return acc, float(F.cross_entropy(logits.double(), labels))
