"""KgCoOp: CoOp plus a penalty keeping the learned class text features near the hand-crafted ones.

Yao et al., "Visual-Language Prompt Tuning with Knowledge-guided Context Optimization", CVPR 2023; the
authors' code is ``KgCoOp/trainers/kgcoop.py`` of htyao89/KgCoOp. The prompt is CoOp's (4 context
vectors from the words "a photo of a", class name at the end); the loss adds, with weight ``adapter.weight``
(8.0 in the authors' scripts, ``scripts/base2new_train.sh``), the distance between each class's learned text
point and its zero-shot point from the run's prompt templates, averaged over all classes
(``fewclip.adapters._family.distance_to_teacher``: ``1 - mean_c cos`` on the sphere, as their code computes
it). The penalty involves every class, whatever the batch holds. Training defaults from
``configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml``: batch 128, 100 epochs, SGD at lr 0.002.

The authors' teacher uses one template per dataset (``data.templates=single``: CoOp's hand-made template,
e.g. "a photo of a {}, a type of pet."); with several, the teacher is their average in the geometry. Their
code initialises the context from "a photo of a" whatever the dataset, so where the template is "a photo of a
{}." the start is zero-shot exactly (penalty 0); elsewhere it is CoOp's word-init start.

With ``adapter.weight=0`` KgCoOp is CoOp (same prompts, same loss, same gradients).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from fewclip.adapter.base import register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import learned_for_classnames, loss_near_teacher, zero_shot_points
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.config.presets import Preset, register_presets


@dataclass
class KgCoOpConfig(CoOpConfig):
    name: str = field(default="kgcoop", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=4, metadata={"help": (
        "Number of context vectors (ignored when ctx_init is given: the words decide).")})
    ctx_init: Optional[str] = field(default="a photo of a", metadata={"help": (
        'Initial words of the context (KgCoOp: "a photo of a"); null = random init.')})
    weight: float = field(default=8.0, metadata={"help": (
        "Weight of the distance to the hand-crafted class points (the authors' W; 8.0 in their scripts).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.weight >= 0:
            raise ValueError(f"adapter.weight must be >= 0, got {self.weight}")


class KgCoOp(CoOp):
    name = "kgcoop"
    supports_new_classes = True
    train_defaults = {"batch_size": 128, "epochs": 100}

    def __init__(self, cfg: KgCoOpConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates, generator=generator)
        self.register_buffer("teacher", zero_shot_points(backbone, self.classnames, self.templates, self.name),
                             persistent=False)  # [C, D] geometry points

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return loss_near_teacher(self, features, labels, self.cfg.weight)

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> KgCoOp:
        return learned_for_classnames(self, classnames, templates)


register_adapter("kgcoop", KgCoOpConfig, KgCoOp, export=STATE)

register_presets(
    "kgcoop",
    Preset("authors", "KgCoOp's vit_b16_ep100_ctxv1 config and scripts: fewclip's defaults "
                      "(tests/parity/test_prompt_parity.py)", not_expressed=(
        "one hand-made template per dataset for the teacher (htyao89/KgCoOp trainers/kgcoop.py): add "
        "data.templates=single",
    )),
)
