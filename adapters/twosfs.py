"""2SFS: two-stage few-shot adaptation, LayerNorms first, then a linear classifier.

Farina et al., "Rethinking Few-Shot Adaptation of Vision-Language Models in Two Stages", CVPR 2025
(FarinaMatteo/rethinking_fewshot_vlms, ``fs/twostage.py`` ``run_twostage``). Their fixed recipe, the defaults
here: ``M`` = 300 x shots optimiser steps in all (``iterations_per_shot``), AdamW lr 2e-4, weight decay 0.01,
batch 32, one template per dataset.

* **Stage 1** (the first ``int(0.6 M)`` steps, ``adapter.stage1_fraction``): the affine parameters of the
  LayerNorms of the transformer blocks of both towers are trained with CLIP's contrastive cross-entropy
  (their ``trainable_norm_params``, ``ln_modality: both``, start block 0); cosine from lr to 1e-6.
* **Stage 2** (the remaining steps): everything is frozen but a linear classifier initialised with the class
  text features of the stage-1 towers; a fresh AdamW state and a new cosine to 1e-6.
* **Inference**: classes it was trained on are scored by the classifier's rows; other class names (base-to-new)
  by the text features of the stage-1 text tower (their ``SingleStreamClassifier.infer``).

The LayerNorms it tunes are fresh copies in a ``shared_copy`` of the module tree (``_towers``): the backbone
is never modified. In stage 2 the image tower runs without gradients. The classifier lives in the geometry's
linear space (``to_linear`` of the text prototypes; logits through ``from_linear``), which on the sphere is
their row-normalised weight. Before training (and with stage 1's LayerNorms unchanged) the logits are the
zero-shot logits in every geometry.

Their ``trainable_norm_params`` marks ``ln_pre``, ``ln_post`` and ``ln_final`` trainable and then frozen again
(each is visited twice, the second time as "not in a block"), so only the blocks' ``ln_1`` and ``ln_2`` learn;
fewclip trains exactly those. The stage switch and both schedules come through ``learning_rate`` (the engine's
hook for a method's own schedule). Exports: ``_towers.TOWER`` (the generic adapter file; with ``merge=true``
also a plain open_clip state dict with the stage-1 LayerNorms, scored zero-shot with the run's templates,
i.e. without the stage-2 classifier).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import AdapterConfig, AdapterError, register_adapter
from fewclip.adapters._towers import TOWER, TowerWeightsAdapter, replace_module, shared_copy, tower_blocks
from fewclip.backbones.attention import parse_layers
from fewclip.config.presets import Preset, register_presets

TOWERS = ("text", "vision", "both")
ETA_MIN = 1e-6  # their CosineAnnealingLR(eta_min=1e-6), both stages


@dataclass
class TwoSFSConfig(AdapterConfig):
    name: str = field(default="2sfs", metadata={"help": "The method (`fewclip adapters` lists them)."})
    towers: str = field(default="both", metadata={"help": "text, vision or both: the towers whose LayerNorms "
                                                          "stage 1 tunes (their ln_modality)"})
    layers: str = field(default="all", metadata={
        "help": "all, first:N, last:N or a comma list of block indices (their ln_*_start: last:K from block "
                "depth-K)"})
    stage1_fraction: float = field(default=0.6, metadata={
        "help": "share of the optimiser steps spent in stage 1 (their n_iters_frac, alpha in the paper)"})

    def __post_init__(self) -> None:
        if self.towers not in TOWERS:
            raise ValueError(f"adapter.towers must be one of {TOWERS}, got {self.towers!r}")
        if not 0 < self.stage1_fraction < 1:
            raise ValueError(f"adapter.stage1_fraction must be in (0, 1), got {self.stage1_fraction}")
        try:
            parse_layers(self.layers, None)
        except ValueError as e:
            raise ValueError(str(e).replace("local_attention layers", "adapter.layers")) from None


def stage_lr(step: int, steps: int, base: float, eta_min: float = ETA_MIN) -> float:
    """torch's ``CosineAnnealingLR(T_max=steps, eta_min)`` at scheduler step ``step``."""
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * step / max(steps, 1))) / 2


class TwoSFS(TowerWeightsAdapter):
    name = "2sfs"
    # 2SFS's fixed recipe (module docstring) instead of CoOp's.
    train_defaults = {"optimizer": "adamw", "lr": 2e-4, "weight_decay": 1e-2, "warmup_epochs": 0,
                      "iterations_per_shot": 300}

    def __init__(self, cfg: TwoSFSConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):  # nothing random: copies and text features
        model = shared_copy(backbone.model)
        super().__init__(cfg, backbone, classnames, templates, model, adapts_text=cfg.towers in ("text", "both"),
                         trains_image_tower=self.will_train_image_tower(cfg))
        self.ln = nn.ModuleDict()
        for tower in (["text", "vision"] if cfg.towers == "both" else [cfg.towers]):
            try:
                prefix, blocks = tower_blocks(model, tower)
            except ValueError as e:
                other = {"text": "vision", "vision": "text"}[tower]
                raise AdapterError(f"2SFS on the {tower} tower needs an open_clip transformer there: {e}; tune "
                                   f"only the other tower with adapter.towers={other}") from None
            try:
                layers = parse_layers(cfg.layers, len(blocks))
            except ValueError as e:
                raise ValueError(f"adapter.towers={cfg.towers}: {e}") from None
            for i in layers:
                for sub in ("ln_1", "ln_2"):
                    name = f"{prefix}.{i}.{sub}"
                    old = model.get_submodule(name)
                    if not isinstance(old, nn.LayerNorm):
                        raise AdapterError(f"2SFS: {name} is a {type(old).__name__}, not a LayerNorm")
                    new = copy.deepcopy(old)  # its own weight and bias, trained; the backbone's stay
                    new.requires_grad_(True)
                    replace_module(model, name, new)
                    self.ln[name.replace(".", "__")] = new
        # Stage 2's classifier [C, D] in the geometry's linear space; set at the switch (and by loading a run).
        with torch.no_grad():
            start = self.backbone.geometry.to_linear(self.prototypes()).float()
        self.classifier = nn.Parameter(start.clone())
        self.register_buffer("stage", torch.ones((), dtype=torch.long))  # 1 or 2; saved with the run
        self._stage = 1  # the same on the host: read at every step without a device sync
        self._stage_trainable()

    @classmethod
    def will_train_image_tower(cls, cfg: TwoSFSConfig) -> bool:
        return cfg.towers in ("vision", "both")

    # -- the two stages --------------------------------------------------------
    def stage1_steps(self, total: int) -> int:
        return int(total * self.cfg.stage1_fraction)

    def learning_rate(self, step: int, total: int, base: float) -> float:
        """Stage 1's cosine over its steps, then (switching at its end) stage 2's over the rest."""
        t1 = self.stage1_steps(total)
        if step < t1:
            self.set_stage(1)
            return stage_lr(step, t1, base)
        self.set_stage(2)
        return stage_lr(step - t1, total - t1, base)

    def set_stage(self, stage: int) -> None:
        if stage == self._stage:
            return
        if stage == 2:  # initialise the classifier with the stage-1 towers' class text features
            with torch.no_grad(), torch.autocast(self.backbone.device.type, enabled=False):
                self.classifier.copy_(self.backbone.geometry.to_linear(self._protos(self.backbone.geometry)))
        self.stage.fill_(stage)
        self._stage = stage
        self._stage_trainable()

    def _stage_trainable(self) -> None:
        stage = self._stage
        for p in self.ln.parameters():
            p.requires_grad_(stage == 1)
        self.classifier.requires_grad_(stage == 2)
        self._fixed_protos = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        # Both stages' tensors go to the optimiser: one of them has no gradient at each step, which AdamW skips
        # (no update, no decay, no state), so this is their two optimisers.
        return list(self.ln.parameters()) + [self.classifier]

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        if self._stage == 2:  # stage 2: the image tower is frozen (their no_grad_backbone=True)
            with torch.no_grad():
                return super().encode_images(pixels)
        return super().encode_images(pixels)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw image features -> [B, C]
        g = self.backbone.geometry
        if self._stage == 2:
            return g.image_logits(features, g.from_linear(self.classifier.float()))
        return g.image_logits(features, self.prototypes())

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> TwoSFS:
        """Other class names: a trained class keeps its classifier row, any other name gets the text prototype
        of the stage-1 text tower (their ``infer``, which knows a class by its name; a name that several
        trained classes share is their rows in turn, so the trained list maps to itself)."""
        return self._for(classnames, templates, None)

    def for_target(self, classnames: Sequence[str], templates: Sequence[str], class_map=None) -> TwoSFS:
        """A domain-shift target's classes (``class_map``: their trained labels) keep their classifier rows by
        label, not by name; other targets as ``for_classnames``."""
        return self._for(classnames, templates, list(class_map) if class_map is not None else None)

    def _for(self, classnames: Sequence[str], templates: Sequence[str], rows: Optional[list[int]]) -> TwoSFS:
        same_rows = rows is None or rows == list(range(len(self.classnames)))
        if (list(classnames) == self.classnames and same_rows
                and (list(templates) or ["a photo of a {}."]) == self.templates):
            return self
        other = type(self)(self.cfg, self.backbone, classnames, templates)
        other.ln.load_state_dict(self.ln.state_dict())
        other._fixed_protos = None
        with torch.no_grad():
            g = self.backbone.geometry
            other.classifier.copy_(g.to_linear(other._protos(g)))
            if self._stage == 2:
                for j, i in enumerate(rows if rows is not None else _rows_by_name(self.classnames, classnames)):
                    if i is not None:
                        other.classifier[j] = self.classifier[i]
                other.stage.fill_(2)
                other._stage = 2
        other._stage_trainable()
        return other.to(self.backbone.device).eval()

    def load_adapter_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        super().load_adapter_state_dict(sd)
        if "stage" in sd:  # the saved stage, read from the state being loaded (host), not from the device
            self._stage = int(sd["stage"])
        self._stage_trainable()

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The backbone's open_clip state dict with the stage-1 LayerNorms (same keys); the stage-2 classifier is
        not part of an open_clip model."""
        sd = dict(self.model.state_dict())
        return self._check_merged(sd)


def _rows_by_name(trained: Sequence[str], names: Sequence[str]) -> list[Optional[int]]:
    """For each of ``names``, the trained row of that name (the k-th time a name is asked for, the k-th trained
    class of that name, or its last one), None for a name not trained on."""
    where: dict[str, list[int]] = {}
    for i, c in enumerate(trained):
        where.setdefault(c, []).append(i)
    used: dict[str, int] = {}
    out: list[Optional[int]] = []
    for c in names:
        if c not in where:
            out.append(None)
            continue
        k = used[c] = used.get(c, -1) + 1
        out.append(where[c][min(k, len(where[c]) - 1)])
    return out


register_adapter("2sfs", TwoSFSConfig, TwoSFS, export=TOWER)

register_presets(
    "2sfs",
    Preset("authors", "2SFS's fixed recipe (FarinaMatteo/rethinking_fewshot_vlms fs/twostage.py): "
                      "fewclip's defaults (tests/parity/test_clip_svd_2sfs_parity.py)"),
)
