"""zs_probe: a linear probe that starts at zero-shot.

One learnable vector ``v_c`` per class, turned into a class point of the
backbone's geometry and scored exactly like a zero-shot prototype::

    logits = geometry.image_logits(raw, geometry.from_linear(v))

with ``from_linear(v) = l2_normalize(v)`` (clip, elliptic, sigmoid), ``v``
(euclidean, euclidean_sq) or ``exp_map0(v, c)`` (hyperbolic, hyperbolic_sq).
``v`` starts at the zero-shot prototypes of ``text_prototypes(backbone,
classnames, templates)`` (through ``to_linear``, the log map, for the hyperbolic geometries),
so before training the logits are the zero-shot logits. This is the
zero-shot-initialised linear probe (ZS-LP) of Silva-Rodriguez et al. (CVPR
2024) with a fixed-strength version of their pull towards the zero-shot
classifier (their CLAP adapts the strength per class), in the family of
text-informed probes such as LP++ (Huang et al., CVPR 2024), carried over to
any geometry.

Training is full-batch Adam on the cached features for ``epochs`` steps,
minimising::

    mean_i CE(logits_i, y_i) + anchor * mean_c ||v_c - v0_c||^2 / r^2

where ``v0`` is the zero-shot initialisation and ``r`` the mean norm of its
rows. This anchor replaces weight decay: decay towards zero would pull
Euclidean and hyperbolic class points to the origin, while the anchor pulls
them towards the text's prediction. ``lr`` is relative in the same way: the
Adam step is ``lr * r / sqrt(D)`` per coordinate, so one setting moves class
vectors by a similar fraction of their size whatever the feature scale.

Model selection: after every step the validation accuracy is measured, and
the kept weights are those of the best step, the zero-shot start (step 0)
included: higher validation accuracy wins, then lower validation
cross-entropy, then the earlier step. The validation accuracy of the result
is therefore never below zero-shot's. Without validation images the last
step is kept (logged as a warning).

The zero-shot initialisation is a non-persistent buffer: it is rebuilt from
the class names and templates when the adapter is constructed, so a saved
state holds ``weight`` only and loads with ``strict=True``.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters.linear_probe import _check_data, _top1
from fewclip.features.encode import progress, text_prototypes

log = logging.getLogger(__name__)



@dataclass
class ZSProbeConfig(AdapterConfig):
    name: str = field(default="zs_probe", metadata={"help": "The method (`fewclip adapters` lists them)."})
    lr: float = field(default=0.01, metadata={"help": (
        "Adam step relative to the class vectors' size (per coordinate: lr * mean ||v0|| / sqrt(D)).")})
    epochs: int = field(default=200, metadata={"help": (
        'Full-batch Adam steps; every step is a checkpoint for validation-based selection.')})
    anchor: float = field(default=1.0, metadata={"help": (
        'Pull towards the zero-shot init: anchor * mean_c ||v_c - v0_c||^2 / (mean_c ||v0_c||)^2.')})

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"adapter.lr must be a positive finite number, got {self.lr!r}")
        if self.epochs < 0:
            raise ValueError(f"adapter.epochs must be >= 0, got {self.epochs}")
        if not (isinstance(self.anchor, (int, float)) and math.isfinite(self.anchor) and self.anchor >= 0):
            raise ValueError(f"adapter.anchor must be a finite number >= 0, got {self.anchor!r}")


class ZSProbe(Adapter):
    """Per-class vectors initialised at the zero-shot prototypes, scored by the backbone's geometry."""

    name = "zs_probe"
    trained_by = "fit"

    def __init__(self, cfg: ZSProbeConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        g = backbone.geometry
        protos = text_prototypes(backbone, self.classnames, self.templates)  # [K, D] geometry points
        v0 = g.to_linear(protos.double()).float()  # float64 for the log map; exact for the other geometries
        # Rebuilt from class names and templates on construction, so not saved.
        self.register_buffer("init", v0, persistent=False)
        self.weight = nn.Parameter(v0.clone())

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        g = self.backbone.geometry
        return g.image_logits(features, g.from_linear(self.weight))  # [B, K]

    def _logits_of(self, img: Tensor, v: Tensor) -> Tensor:
        """Already embedded images [B, D] (fit embeds its features once) and class vectors [K, D] -> [B, K]."""
        g = self.backbone.geometry
        return g.logits(img, g.from_linear(v))

    def fit(self, data) -> dict:
        """Adam from the zero-shot init; keeps the step with the best validation accuracy (step 0 included)."""
        cfg: ZSProbeConfig = self.cfg
        K, D = self.weight.shape
        (train_x, train_y), (val_x, val_y) = data.train, data.val
        for name, x, y in (("train", train_x, train_y), ("val", val_x, val_y)):
            _check_data(f"zs_probe.fit {name}", x, y, K, D)
        if train_y.numel() == 0:
            raise ValueError("zs_probe.fit needs training images, got none")
        dev, g = self.weight.device, self.backbone.geometry
        with torch.no_grad():
            img_t, img_v = g.embed_image(train_x.to(dev)), g.embed_image(val_x.to(dev))
            self.weight.copy_(self.init)  # training always starts at zero-shot
        yt, yv = train_y.to(dev), val_y.to(dev)
        v0 = self.init
        r = v0.norm(dim=-1).mean().clamp_min(1e-12)
        has_val = yv.numel() > 0
        if not has_val:
            log.warning("zs_probe: no validation images; keeping the last step instead of selecting one")

        @torch.no_grad()
        def validate() -> tuple[float, float]:
            if not has_val:
                return float("nan"), float("nan")
            logits = self._logits_of(img_v, self.weight)
            return _top1(logits, yv), float(F.cross_entropy(logits, yv))

        acc, loss = validate()
        zs_acc = acc
        best = {"epoch": 0, "acc": acc, "loss": loss, "weight": self.weight.detach().clone()}
        opt = torch.optim.Adam([self.weight], lr=cfg.lr * float(r) / math.sqrt(D))
        train_loss = float("nan")
        with torch.enable_grad():
            for epoch in progress(range(1, cfg.epochs + 1), desc="zs probe", unit="step", leave=False):
                ce = F.cross_entropy(self._logits_of(img_t, self.weight), yt)
                pull = (self.weight - v0).pow(2).sum(-1).mean() / r.pow(2)
                total = ce + cfg.anchor * pull
                opt.zero_grad(set_to_none=True)
                total.backward()
                opt.step()
                train_loss = float(total.detach())
                acc, loss = validate()
                if not has_val or (acc, -loss) > (best["acc"], -best["loss"]):
                    best = {"epoch": epoch, "acc": acc, "loss": loss, "weight": self.weight.detach().clone()}
        with torch.no_grad():
            self.weight.copy_(best["weight"])
        log.info("zs probe: kept step %d of %d (val top1 %.2f%%, zero-shot %.2f%%)",
                 best["epoch"], cfg.epochs, best["acc"], zs_acc)
        return {
            "best_epoch": best["epoch"],
            "epochs": cfg.epochs,
            "val_acc": best["acc"] if has_val else None,
            "zeroshot_val_acc": zs_acc if has_val else None,
            "val_loss": best["loss"] if has_val else None,
            "train_loss": train_loss,
        }


register_adapter("zs_probe", ZSProbeConfig, ZSProbe, export=STATE)
