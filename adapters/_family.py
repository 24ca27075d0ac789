"""What the text-prompt methods built on CoOp share (CoCoOp, KgCoOp, ProGrad, TCP): shared plumbing.

* ``default_linear``: an ``nn.Linear`` with PyTorch's default initialisation, drawn from a generator
  (the authors' meta-networks use the default init; fewclip never draws from the global RNG).
* ``zero_shot_points``: the hand-crafted class points (the zero-shot classifier of the run's templates),
  the teacher of KgCoOp, ProGrad and TCP.
* ``distance_to_teacher``, ``loss_near_teacher``: KgCoOp's and TCP's penalty in any geometry, and their loss.
* ``learned_for_classnames``: ``for_classnames`` of a method whose learned tensors do not depend on the
  class names (a shared context, a meta-network).
* ``text_output_dim``: the width of the towers' joint embedding (the meta-networks' input).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.adapter.base import Adapter, AdapterError
from fewclip.features.encode import text_prototypes


def default_linear(in_features: int, out_features: int, generator: torch.Generator, *, zero: bool = False,
                   device: Optional[torch.device] = None) -> nn.Linear:
    """``nn.Linear(in, out)`` initialised as PyTorch initialises it (weight and bias uniform in
    +-1/sqrt(in): ``kaiming_uniform_(a=sqrt(5))`` and the bias rule of ``Linear.reset_parameters``), drawn
    from ``generator``; ``zero``: all zeros."""
    layer = nn.Linear(in_features, out_features, device="meta").to_empty(device="cpu")
    bound = 1.0 / math.sqrt(in_features)
    with torch.no_grad():
        if zero:
            layer.weight.zero_()
            layer.bias.zero_()
        else:
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.uniform_(-bound, bound, generator=generator)
    return layer.to(device) if device is not None else layer


def zero_shot_points(backbone, classnames: Sequence[str], templates: Sequence[str], method: str) -> torch.Tensor:
    """The zero-shot class points [C, D] of ``templates`` (several templates are averaged by the geometry;
    the authors use one per dataset, ``data.templates=single``)."""
    if not templates:
        raise AdapterError(f"adapter {method!r} compares its prompts with the hand-crafted ones and needs the "
                           f"dataset's prompt templates; give them (data.templates=single or ensemble)")
    return text_prototypes(backbone, classnames, templates)


def distance_to_teacher(geometry, points: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Half the mean squared distance between learned class points [C, D] and the hand-crafted ones [C, D],
    in the geometry's linear space. On the sphere (clip, elliptic, sigmoid) the points are unit vectors and
    this is ``1 - mean_c cos(t_c, w_c)``, KgCoOp's and TCP's term as their code computes it (KgCoOp's paper
    writes the squared distance ``||t - w||^2 = 2 (1 - cos)``); in the Euclidean and hyperbolic geometries
    it is the same squared distance between the points' coordinates (the tangent space at the origin for
    the hyperboloid), which is smooth where the two coincide, as a geodesic distance is not."""
    d = geometry.to_linear(points) - geometry.to_linear(teacher)
    return 0.5 * d.pow(2).sum(-1).mean()


def loss_near_teacher(adapter, features: torch.Tensor, labels: torch.Tensor, weight: float) -> dict[str, torch.Tensor]:
    """Cross-entropy plus ``weight`` times ``distance_to_teacher`` of the adapter's class points to its
    ``teacher`` buffer (KgCoOp, TCP); with weight 0, the cross-entropy alone (CoOp's loss)."""
    g = adapter.backbone.geometry
    points = adapter.prototypes()  # C, D
    ce = F.cross_entropy(g.image_logits(features, points).float(), labels)
    if weight == 0:
        return {"loss": ce}
    kg = distance_to_teacher(g, points, adapter.teacher)
    return {"loss": ce + weight * kg, "ce": ce, "kg": kg}


def learned_for_classnames(adapter: Adapter, classnames: Sequence[str], templates: Sequence[str], *,
                           scores_with_templates: bool = False) -> Adapter:
    """``adapter``'s learned tensors on other class names: the same method rebuilt for ``classnames`` and
    ``templates`` (class-name buffers, a teacher of the new classes), then its saved state loaded (a context
    shared by all classes, a meta-network; a class-specific context cannot move to other classes). The same
    names give the adapter itself, unless its logits depend on the templates (``scores_with_templates``: TCP)
    and those differ."""
    same_templates = not scores_with_templates or list(templates) == adapter.templates
    if list(classnames) == adapter.classnames and same_templates:
        return adapter
    if getattr(adapter.cfg, "csc", False):
        raise AdapterError(f"adapter {adapter.name!r} with adapter.csc=true learns one context per trained class "
                           f"and cannot score other class names; use a unified context (adapter.csc=false)")
    other = type(adapter)(adapter.cfg, adapter.backbone, classnames, templates)
    other.load_adapter_state_dict(adapter.adapter_state_dict())
    return other.to(adapter.backbone.device).eval()


def text_output_dim(tower) -> int:
    """Width D of the text tower's output (the joint embedding, as wide as the image features)."""
    proj = tower.text_projection
    if proj is None:
        return tower.width
    return int(proj.out_features if isinstance(proj, nn.Linear) else proj.shape[1])
