"""TaskRes: a learnable residual on the zero-shot text classifier, starting at zero.

Yu et al., "Task Residual for Tuning Vision-Language Models", CVPR 2023; defaults from the authors' code
(github.com/geekyutao/TaskRes @ 5195359, ``trainers/taskres.py``, ``configs/trainers/TaskRes/
adam_lr2e-3_B256_ep100.yaml``, ``scripts/taskres/main.sh``)::

    logits(x) = scale * cos(x, base_c + scale_r * R_c)       # R: [C, D], zeros at the start

``base`` is the text classifier in the text tower's **output space** (the authors average the raw text
features of the templates and normalise only after adding the residual), and ``scale_r`` is the residual
scale (``RESIDUAL_SCALE`` 0.5, 1.0 only for Flowers). Training: Adam lr 2e-3 with L2 weight decay 5e-4
added to the gradient (Dassl's ``adam``: ``torch.optim.Adam``, not AdamW; the 5e-4 is Dassl's default),
batch 256, cosine after one warm-up epoch at 1e-5, cross-entropy, last epoch. These are the adapter's
``train`` defaults. The authors train 100 epochs at 1/2/4 shots and 200 at 8/16; fewclip keeps CoOp's
schedule by shots (50/100/100/200/200: the same except 50 at 1 shot), since a run's ``train`` section
holds one ``epochs`` value or CoOp's schedule (``train.epochs=100`` gives the authors' 1-shot runs). The
authors re-augment every epoch; fewclip trains on the run's cached views.

Geometry: the classifier point is ``geometry.embed_text(base + scale_r * R)``: the residual is added in
the text tower's output space, as in the authors' code, and the geometry embeds the sum like any text
feature (normalised on the sphere, divided by sqrt(D) for the Euclidean geometries, scaled and lifted by
the exponential map for the hyperbolic ones). ``base`` is the raw-space preimage of the zero-shot
prototypes of the run's templates (``fewclip.adapters._cache.raw_preimage``): the template mean of the
raw text features for the Euclidean and hyperbolic geometries; on the sphere the prototype's direction at
the raw mean's norm, which with one template is the authors' base exactly, and with several keeps
fewclip's prototype (templates normalised, then averaged; the authors average raw features, which weighs
templates by their norms). So at the start (R = 0) the logits are the zero-shot logits in every geometry,
and the residual moves the classifier by as much, relative to its norm, as in the authors' code.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import text_classifier
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class TaskResConfig(AdapterConfig):
    name: str = field(default="taskres", metadata={"help": "The method (`fewclip adapters` lists them)."})
    scale: float = field(default=0.5, metadata={"help": "The residual's scale (the authors' RESIDUAL_SCALE)."})

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"adapter.scale must be > 0, got {self.scale}")


class TaskRes(Adapter):
    """The zero-shot text classifier plus a learned residual, in the text tower's output space."""

    name = "taskres"
    train_defaults = {"optimizer": "adam", "lr": 2e-3, "weight_decay": 5e-4, "batch_size": 256}

    def __init__(self, cfg: TaskResConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: the residual starts at zero
        super().__init__(cfg, backbone, classnames, templates)
        base = text_classifier(backbone, self.classnames, self.templates).base  # [C, D]
        self.register_buffer("base", base, persistent=False)  # rebuilt from the class names
        self.residual = nn.Parameter(torch.zeros_like(base))

    def class_points(self) -> Tensor:
        """The classifier [C, D]: points of the geometry."""
        return self.backbone.geometry.embed_text(self.base + self.cfg.scale * self.residual)

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        return self.backbone.geometry.image_logits(features, self.class_points())  # [B, C]


register_adapter("taskres", TaskResConfig, TaskRes, export=STATE)

CLAP_CFG = "jusiro/CLAP@dbdf409 configs/trainers/SGD_lr1e-1_B256_ep300.yaml"
register_presets(
    "taskres",
    Preset("authors", "TaskRes's released code (trainers/taskres.py, configs/trainers/TaskRes/"
                      "adam_lr2e-3_B256_ep100.yaml); fewclip's optimiser defaults are theirs", not_expressed=(
        "100 epochs at 1, 2, 4 shots and 200 at 8, 16 (geekyutao/TaskRes@5195359 configs/trainers/TaskRes/"
        "adam_lr2e-3_B256_ep100.yaml:20, scripts/taskres/main.sh); fewclip's CoOp schedule differs at 1 shot (50): "
        "add train.epochs=100 there",
        "RESIDUAL_SCALE is an argument of each of their runs (geekyutao/TaskRes@5195359 scripts/taskres/main.sh:12; "
        "eval.sh:10 sets 0.5, fewclip's default): set adapter.scale per dataset")),
    Preset("clap", "TaskRes as CLAP's repository re-runs it (INIT TR), which many papers quote", settings=(
        Setting("train.optimizer", "sgd", f"{CLAP_CFG}:16", "CLAP's one config for every method"),
        Setting("train.lr", 0.1, f"{CLAP_CFG}:17", "CLAP's one config for every method"),
        Setting("train.weight_decay", 0.0, f"{CLAP_CFG}:23", "CLAP's one config for every method"),
        Setting("train.epochs", 300, f"{CLAP_CFG}:18", "CLAP's one config for every method"),),
        not_expressed=("CLAP's epoch of pooled augmented views (jusiro/CLAP@dbdf409 trainers/adapters.py:435-447)",)),
)
