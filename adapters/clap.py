"""CLAP: a zero-shot-initialised linear probe held near the zero-shot prototypes by class-adaptive penalties.

Silva-Rodriguez et al., "A Closer Look at the Few-Shot Adaptation of Large Vision-Language Models", CVPR
2024; defaults from the authors' code (github.com/jusiro/CLAP @ dbdf409, ``trainers/adapters.py``,
``configs/trainers/SGD_lr1e-1_B256_ep300.yaml``, ``scripts/adapt.sh``)::

    logits(x) = scale * cos(x, w_c)                                  # w: [C, D], starts at base
    loss = CE + mean_c lambda_c ||w_c - base_c||^2
    lambda_c = mean over the augmented training images of class c of the zero-shot probability of class c

``base`` is the zero-shot text classifier in the text tower's output space (raw template-averaged text
features, as for TaskRes), ``w`` is trained in that space and normalised only in the logits. The
multipliers are computed once from the zero-shot logits of every augmented view of the training images:
the published commands (``experiment_CLAP.txt``: ``ZS l2``) never enable the augmented-Lagrangian update
(``outer_step`` runs only for constraints containing "adaptative"), so the released CLAP keeps them fixed,
and so does fewclip. ``constraint="none"`` is the authors' ZS-LP baseline (the same probe, CE only).

Training (the adapter's ``train`` defaults; ``fit`` runs the engine's loop): SGD lr 0.1, momentum 0.9, no
weight decay, cosine after one warm-up epoch at 1e-5, batch 256, 300 epochs, last epoch, on ``views`` (20)
augmented views of each training image (the authors' ``epochs_aumentation``, here the run's shared views 0-19,
the same Tip-Adapter-F uses). An epoch of the authors' code is ``ceil(N / 256)`` batches drawn from a
permutation of all 20 N augmented features; an epoch here is the N images of one view (view e mod 20) in
``ceil(N / 256)`` batches: as many steps, each on one view instead of a mix of views. ``pool_views=true``
(``preset=authors``) trains as their trainer does: each epoch the first ``ceil(N / 256)`` batches of a fresh
shuffle of all 20 N features (``PooledViews``).

Geometry: as TaskRes, the class points are ``geometry.embed_text(w)`` and the penalty is measured in the text
tower's output space (``fewclip.adapters.taskres``; ``base`` is the raw-space preimage of the run's
zero-shot prototypes), the multipliers from the geometry's zero-shot logits. At the start (``w = base``) the
logits are the zero-shot logits in every geometry.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import text_classifier
from fewclip.config.presets import Preset, Setting, register_presets
from fewclip.features.encode import Features
from fewclip.training.engine import CachedFeatures, FeatureSource, train_loop

log = logging.getLogger(__name__)

CONSTRAINTS = ("l2", "none")


@dataclass
class ClapConfig(AdapterConfig):
    name: str = field(default="clap", metadata={"help": "The method (`fewclip adapters` lists them)."})
    views: int = field(default=20, metadata={"help": (
        "Augmented views of each training image trained on (the authors' epochs_aumentation).")})
    constraint: str = field(default="l2", metadata={"help": (
        '"l2": CLAP\'s class-adaptive penalty; "none": ZS-LP (cross-entropy only).')})
    pool_views: bool = field(default=False, metadata={"help": (
        "Pool every view of every training image into one training set, an epoch being ceil(N / batch) batches of "
        "a shuffle of all of them (the authors' trainer); false: epoch e trains on view e mod views.")})

    def __post_init__(self) -> None:
        if self.views < 1:
            raise ValueError(f"adapter.views must be >= 1, got {self.views}")
        if self.constraint not in CONSTRAINTS:
            raise ValueError(f"adapter.constraint must be one of {', '.join(CONSTRAINTS)}, got {self.constraint!r}")


def class_multipliers(zs_logits: Tensor, labels: Tensor, n_classes: int) -> Tensor:
    """CLAP's lambda [C]: per class, the mean zero-shot probability of the true class over its samples."""
    N, C = zs_logits.shape
    onehot = F.one_hot(labels, n_classes).to(zs_logits.dtype)  # [N, C]
    p = zs_logits.softmax(-1)
    return (p * onehot).sum(0) / onehot.sum(0).clamp_min(1)


class PooledViews(FeatureSource):
    """Every view of every training image as one training set (the authors' trainer): an epoch is the first
    ``ceil(N / batch)`` batches of a fresh shuffle of all V x N features, N the training images."""

    def __init__(self, views: Sequence[Features], val: Features):
        self.x = torch.cat([v.x for v in views])  # [V N, D], view-major
        self.labels = torch.cat([v.y for v in views])
        self.images, self.val = len(views[0].y), val

    @property
    def epoch_size(self) -> int:
        return self.images

    def batch(self, epoch: int, idx: Tensor) -> Tensor:
        return self.x[idx]

    def frozen(self, epoch: int, idx: Tensor) -> Tensor:
        return self.x[idx]  # cached features are the frozen tower's

    def validation(self) -> Features:
        return self.val


class Clap(Adapter):
    """Class weights in the text tower's output space, pulled towards the zero-shot ones."""

    name = "clap"
    trained_by = "fit"
    train_defaults = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "batch_size": 256,
                      "epochs": 300}

    def __init__(self, cfg: ClapConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: starts at zero-shot
        super().__init__(cfg, backbone, classnames, templates)
        base = text_classifier(backbone, self.classnames, self.templates).base  # [C, D]
        self.register_buffer("base", base, persistent=False)  # rebuilt from the class names
        self.register_buffer("multipliers", torch.ones(len(base)), persistent=False)  # set by fit
        self.weight = nn.Parameter(base.clone())

    def class_points(self) -> Tensor:
        return self.backbone.geometry.embed_text(self.weight)  # [C, D]

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        return self.backbone.geometry.image_logits(features, self.class_points())  # [B, C]

    def penalty(self) -> Tensor:
        """mean_c lambda_c ||w_c - base_c||^2 (0 for ``constraint="none"``)."""
        if self.cfg.constraint == "none":
            return self.weight.new_zeros(())
        return (self.multipliers * (self.weight - self.base).pow(2).sum(-1)).mean()

    def training_loss(self, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
        ce = F.cross_entropy(self(features).float(), labels)
        penalty = self.penalty()
        return {"loss": ce + penalty, "ce": ce, "penalty": penalty}

    def fit_views(self) -> int:
        return self.cfg.views

    @torch.no_grad()
    def set_multipliers(self, features: Tensor, labels: Tensor) -> None:
        """lambda from the zero-shot logits of raw features [N, D] with labels [N]."""
        g = self.backbone.geometry
        zs = g.image_logits(features.to(self.base.device), g.embed_text(self.base))
        self.multipliers = class_multipliers(zs.float(), labels.to(zs.device), len(self.classnames))

    def fit(self, data) -> dict:
        """lambda from every view's zero-shot logits, then the engine's loop from the zero-shot weights."""
        views = data.views[: self.cfg.views]
        with torch.no_grad():
            self.weight.copy_(self.base)
        self.set_multipliers(torch.cat([v.x for v in views]), torch.cat([v.y for v in views]))
        source = PooledViews(views, data.val) if self.cfg.pool_views else CachedFeatures(views, data.val)
        info = train_loop(self, source, data.cfg, data.shots, data.generator)
        return {**info, "multipliers": [round(float(m), 6) for m in self.multipliers]}


register_adapter("clap", ClapConfig, Clap, export=STATE)

CLAP_REPO = "jusiro/CLAP@dbdf409"
register_presets(
    "clap",
    Preset("authors", "CLAP's released code (trainers/adapters.py, configs/trainers/SGD_lr1e-1_B256_ep300.yaml)",
           settings=(Setting("adapter.pool_views", True, f"{CLAP_REPO} trainers/adapters.py:431-447",
                             "their epoch: ceil(N/256) batches of a shuffle of all 20 views pooled into one set"),)),
    Preset("zslp", "the ZS-LP baseline of CLAP's repository (the same probe, cross-entropy only)", settings=(
        Setting("adapter.constraint", "none", f"{CLAP_REPO} experiments/experiment_ZSLP.txt:2",
                "ZS-LP is CLAP's probe without the class-adaptive penalty (INIT ZS, CONSTRAINT none)"),
        Setting("adapter.pool_views", True, f"{CLAP_REPO} trainers/adapters.py:431-447",
                "their epoch: ceil(N/256) batches of a shuffle of all 20 views pooled into one set"),)),
)
