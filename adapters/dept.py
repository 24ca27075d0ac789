"""DePT: decoupled prompt tuning, a channel-adjusted linear head for the base classes on top of a prompt learner.

Zhang et al., "DePT: Decoupled Prompt Tuning", CVPR 2024; code ``trainers/elp_coop.py`` and
``trainers/elp_maple.py`` of ``Koorye/DePT`` (``CustomCLIP._forward_base`` / ``_forward_new``). A prompt
learner (CoOp or MaPLe, fewclip's own ``adapters/coop.py`` / ``adapters/maple.py``, unchanged) gives raw text
features t_c [C, D] and raw image features v [B, D]. DePT adds

* the channel-wise transformation (cwT, their ``FiLM``): per-channel scale and shift of the raw features,
  one for each tower, ``t' = s_t * t + b_t``, ``v' = s_v * v + b_v`` (scales start at 1, shifts at 0);
* a linear head ``h(x) = W x + c`` over the base classes (``nn.Linear(D, C)``, PyTorch's default init), on
  the transformed *raw* features, as in their code (no normalisation, no logit scale).

Training (``training_loss``): the similarity logits of the learner (``ce``, in the backbone's geometry:
cosine x logit scale for CLIP, as theirs) and the head's cross-entropy on the text features of the
batch's labels stacked on the image features, both labelled y (``ce_head``, their
``torch.cat([text_feats[labels], img_feats])``):

    L = (1 - head_weight) * ce + head_weight * ce_head           (head_weight 0.7)

The head and the cwT learn ``head_lr_scale`` (6.5) times faster than the prompts (their ``STAGED_LR`` with
``LR_EXP``: the prompts at 0.0035, the new layers at 0.02275); the warm-up learning rate is the same for both.

Scoring follows the authors: the trained (base) classes get the fused logits
``(1 - head_weight) * similarity + head_weight * head`` (their ``TEST_TIME_FUSION``; ``fusion=false``: the
head alone); any other class names (base-to-novel's new classes, a cross-dataset or domain-shift target)
get the learner's similarity logits alone (``for_classnames``: the head is dropped, as their
``SUBSAMPLE_CLASSES != "base"`` path does). With a word-initialised learner (``ctx_init``), new classes are
therefore scored as zero-shot CLIP before training (tested in every geometry).

Defaults: their CoOp + DePT run (``configs/trainers/ExtrasLinearProbeCoOp/vit_b16_ep10_bs4_lr35.yaml`` with
``train.py``'s ``extend_cfg``: 16 random context vectors, SGD lr 0.0035, 10 epochs, batch 4, weight 0.7,
lr x 6.5 for the head). MaPLe + DePT (their ``ExtrasLinearProbeMaPLe``): ``adapter=dept-maple``
(``adapter.learner=maple adapter.n_ctx=2 adapter.ctx_init='a photo of a' adapter.depth=9``). Their cosine
schedule steps once per epoch; fewclip's engine steps per iteration.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.adapter.base import Adapter, AdapterConfig, AdapterError, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import default_linear, text_output_dim
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.adapters.maple import MaPLe, MaPLeConfig
from fewclip.config.presets import Preset, Setting, register_presets

LEARNERS = ("coop", "maple")


@dataclass
class DePTConfig(AdapterConfig):
    name: str = field(default="dept", metadata={"help": "The method (`fewclip adapters` lists them)."})
    learner: str = field(default="coop", metadata={"help": "the prompt learner under the head: coop or maple"})
    n_ctx: int = field(default=16, metadata={"help": "context vectors (coop: ignored when ctx_init gives words; "
                                                      "maple: tokens per layer)"})
    ctx_init: Optional[str] = field(default=None, metadata={"help": "words initialising the context; null = "
                                                                    "N(0, init_std) (CoOp + DePT's default)"})
    init_std: float = field(default=0.02, metadata={"help": "std of the random context init"})
    depth: int = field(default=9, metadata={"help": "MaPLe's prompted layers (learner=maple only)"})
    checkpointing: bool = field(default=False, metadata={"help": "recompute MaPLe's blocks in the backward pass "
                                                                 "(less memory; learner=maple only)"})
    head_weight: float = field(default=0.7, metadata={"help": "weight of the head in the loss and the fused "
                                                              "base-class logits (their LINEAR_PROBE.WEIGHT)"})
    head_lr_scale: float = field(default=6.5, metadata={"help": "learning rate of the head and cwT over the "
                                                                "prompts' (their LR_EXP)"})
    cwt: bool = field(default=True, metadata={"help": "channel-wise transformation before the head "
                                                      "(their FILM.LINEAR_PROBE)"})
    fusion: bool = field(default=True, metadata={"help": "score base classes by the fused logits (true) or the "
                                                         "head alone (their TEST_TIME_FUSION)"})

    def __post_init__(self) -> None:
        if self.learner not in LEARNERS:
            raise ValueError(f"adapter.learner must be one of {LEARNERS}, got {self.learner!r}")
        if self.n_ctx < 1:
            raise ValueError(f"adapter.n_ctx must be >= 1, got {self.n_ctx}")
        if self.ctx_init is not None and not self.ctx_init.strip():
            raise ValueError("adapter.ctx_init must contain words, or be null for random init")
        if self.init_std <= 0:
            raise ValueError(f"adapter.init_std must be > 0, got {self.init_std}")
        if self.depth < 1:
            raise ValueError(f"adapter.depth must be >= 1, got {self.depth}")
        if not 0 <= self.head_weight <= 1:
            raise ValueError(f"adapter.head_weight must be in [0, 1], got {self.head_weight}")
        if self.head_lr_scale <= 0:
            raise ValueError(f"adapter.head_lr_scale must be > 0, got {self.head_lr_scale}")


def learner_for(cfg: DePTConfig, backbone, classnames: Sequence[str], templates: Sequence[str],
                generator: torch.Generator) -> Adapter:
    """The prompt learner DePT sits on (fewclip's own CoOp or MaPLe, built from DePT's fields)."""
    if cfg.learner == "maple":
        mcfg = MaPLeConfig(n_ctx=cfg.n_ctx, depth=cfg.depth, ctx_init=cfg.ctx_init, init_std=cfg.init_std,
                           checkpointing=cfg.checkpointing)
        return MaPLe(mcfg, backbone, classnames, templates, generator=generator)
    ccfg = CoOpConfig(n_ctx=cfg.n_ctx, ctx_init=cfg.ctx_init, init_std=cfg.init_std)
    return CoOp(ccfg, backbone, classnames, templates, generator=generator)


class ChannelTransform(nn.Module):
    """Per-channel scale and shift of features [N, D] (DePT's cwT, their ``FiLM``): scale 1, shift 0 at init."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim, device=device))
        self.shift = nn.Parameter(torch.zeros(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.shift


class DePT(Adapter):
    name = "dept"
    uses_text_tower = True
    supports_new_classes = True
    # their configs: SGD lr 0.0035, 10 epochs, batch 4 (warm-up 1 epoch at 1e-5)
    train_defaults = {"lr": 0.0035, "epochs": 10, "batch_size": 4}

    @classmethod
    def will_train_image_tower(cls, cfg: DePTConfig) -> bool:
        """MaPLe's vision prompts put the image tower in every step; CoOp trains on cached features."""
        return cfg.learner == "maple"

    def __init__(self, cfg: DePTConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None, head: bool = True):
        super().__init__(cfg, backbone, classnames, templates)
        generator = default_generator(generator)
        self.learner = learner_for(cfg, backbone, self.classnames, self.templates, generator)
        self.trains_image_tower = self.learner.trains_image_tower
        self.has_head = bool(head)
        if self.has_head:  # the base classes': the head and its cwT (other class names get neither)
            D, device = text_output_dim(self.learner.tower), backbone.device
            self.head = default_linear(D, len(self.classnames), generator, device=device)
            if cfg.cwt:
                self.cwt_text = ChannelTransform(D, device)
                self.cwt_image = ChannelTransform(D, device)

    # -- features and logits ---------------------------------------------------
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.learner.encode_images(pixels)

    def _cwt(self, text: torch.Tensor, image: torch.Tensor):
        if not self.cfg.cwt:
            return text, image
        return self.cwt_text(text), self.cwt_image(image)

    def similarity_logits(self, features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The learner's logits [B, C] in the backbone's geometry from raw image [B, D] and text [C, D] features."""
        g = self.backbone.geometry
        return g.image_logits(features, g.prototype(g.embed_text(text).unsqueeze(1)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # raw image features [B, D] -> logits [B, C]
        text = self.learner.text_features()
        sim = self.similarity_logits(features, text)
        if not self.has_head:
            return sim
        _, image = self._cwt(text, features.float())
        head = self.head(image)
        if not self.cfg.fusion:
            return head
        w = self.cfg.head_weight
        return (1 - w) * sim + w * head

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.has_head:
            raise AdapterError("this DePT adapter scores new classes with its prompts only and has no head to "
                               "train; train on the base classes")
        text = self.learner.text_features()  # C, D raw
        ce = F.cross_entropy(self.similarity_logits(features, text).float(), labels)
        t, v = self._cwt(text.float(), features.float())
        head_logits = self.head(torch.cat([t[labels], v]))  # 2B, C
        ce_head = F.cross_entropy(head_logits, torch.cat([labels, labels]))
        w = self.cfg.head_weight
        return {"loss": (1 - w) * ce + w * ce_head, "ce": ce.detach(), "ce_head": ce_head.detach()}

    # -- optimisation ----------------------------------------------------------
    def param_groups(self) -> list[dict]:
        """The prompts at the run's learning rate; the head and the cwT at ``head_lr_scale`` times it."""
        prompts = self.learner.trainable_parameters()
        new = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("learner.")]
        groups = [{"params": prompts, "lr_scale": 1.0}]
        if new:
            groups.append({"params": new, "lr_scale": float(self.cfg.head_lr_scale)})
        return groups

    # -- other class names -----------------------------------------------------
    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> DePT:
        """Other class names are scored by the learned prompts alone (the head knows the base classes only)."""
        if list(classnames) == self.classnames:
            return self
        other = type(self)(self.cfg, self.backbone, classnames, templates, head=False)
        other.learner.load_adapter_state_dict(self.learner.adapter_state_dict())
        return other.to(self.backbone.device).eval()

    def for_target(self, classnames: Sequence[str], templates: Sequence[str], class_map=None) -> DePT:
        """A target holding every trained class in label order (a domain-shift target: ImageNet-V2, -Sketch)
        gets the head, as the authors' ``'ImageNet' in DATASET.NAME`` rule gives it (Koorye/DePT@d4ff416
        trainers/elp_coop.py:38-39); any other target the learned prompts alone, even one whose class names are
        the trained ones (a cross-dataset target). A class subset (ImageNet-A, -R) also gets the prompts alone:
        the authors' rule would build a 200-class head, which their 1000-class checkpoint does not load into."""
        if class_map is not None and list(class_map) == list(range(len(self.classnames))):
            return self
        other = type(self)(self.cfg, self.backbone, classnames, templates, head=False)
        other.learner.load_adapter_state_dict(self.learner.adapter_state_dict())
        return other.to(self.backbone.device).eval()


register_adapter("dept", DePTConfig, DePT, export=STATE)

DEPT_MAPLE = "Koorye/DePT@d4ff416 configs/trainers/ExtrasLinearProbeMaPLe/vit_b16_c2_ep10_batch4_2ctx.yaml"
register_presets(
    "dept",
    Preset("authors", "DePT on CoOp, their ExtrasLinearProbeCoOp config (vit_b16_ep10_bs4_lr35.yaml): fewclip's "
                      "defaults (tests/parity/test_dept_mmrl_coprompt_parity.py)", not_expressed=(
        "their cosine schedule steps once per epoch; fewclip's per iteration",)),
    Preset("maple", "DePT on MaPLe, their ExtrasLinearProbeMaPLe config", settings=(
        Setting("adapter.learner", "maple", "Koorye/DePT@d4ff416 trainers/elp_maple.py", "the MaPLe prompt learner"),
        Setting("adapter.n_ctx", 2, f"{DEPT_MAPLE}:33", "MaPLe's 2 tokens"),
        Setting("adapter.ctx_init", "a photo of a", f"{DEPT_MAPLE}:34", "MaPLe's word init"),)),
)
