"""MMRL: a shared multi-modal representation space projected into the higher layers of both towers.

Guo et al., "MMRL: Multi-Modal Representation Learning for Vision-Language Models", CVPR 2025; code
``trainers/mmrl.py`` and ``clip/model_mmrl.py`` of ``yunncheng/MMRL``. Learnable representation tokens
R [n, rep_dim] live in a space of their own; for each of the last ``rep_depth`` layers of each tower a
Linear maps them into that tower's width (``R W_l^T + b_l``; the Linears of a tower start as identical
copies of one default-initialised Linear, as their ``_get_clones``). Where they go
(``adapters/_deep.py``: ``encode_image_deep(first=...)``, ``encode_text_inserted``):

* **image tower**: appended to the input of the first representation layer (after ``ln_pre``, which they
  do not go through), replaced before every later one. Their code puts them right after the class token;
  fewclip appends them after the patches, which is the same computation (no positional embedding is added
  inside the blocks, and attention is indifferent to the order of its tokens). Two image features: the
  class token's (``ln_post``, ``proj``: the usual one) and the representation features, ``ln_post`` of each
  representation token's output, averaged, times a learnable projection ``proj_rep`` [W, D] (their
  ``proj_rep``, a new N(0, W^-1/2) matrix, not a copy of ``proj``).
* **text tower**: the class prompt is the dataset's hand-crafted template (no learnable context); the
  mapped tokens are inserted after the start token before the first representation layer (shifting the
  rest; the causal mask and the end-token pooling follow), replaced before every later one. The layers
  below the first representation layer do not depend on anything learned: fewclip computes them once.

Logits: the class-token logits and the representation logits against the same text points; training

    L = alpha * CE(logits) + (1 - alpha) * CE(logits_rep)
      + reg_weight * (1 - mean cos(v, v0)) + reg_weight * (1 - mean cos(t, t0))

with v, t the class-token image points and the text points, v0 the frozen image tower's features of the
same view (the feature cache, ``wants_frozen_features``; their code runs a second image tower every step)
and t0 the frozen text tower's features of the same template (computed once), the cosines taken in the
geometry's linear space (for CLIP: the features, as theirs). Scoring follows the authors: the trained
data it was trained on gets ``alpha * logits + (1 - alpha) * logits_rep`` (base-to-novel's base classes,
few-shot, the cross-dataset or domain-shift source); every other test set (``for_target``: new classes,
cross-dataset targets, and domain-shift targets even where they keep the trained class names, as ImageNet-V2
and -Sketch do) the class-token logits alone.

``encode_images`` returns both image features side by side, [B, 2D] (class token, then representation);
``forward`` also takes [B, D] features (another image tower's), scored by the class-token logits alone.

Defaults: ``configs/trainers/MMRL/vit_b16.yaml`` (base-to-novel: 5 tokens, rep_dim 512, layers 6..12 of
12 = the last 7, alpha 0.7, reg_weight 1.0, AdamW lr 0.001, 10 epochs, batch 4, crops of scale 0.5 to 1).
Their per-dataset ``REG_WEIGHT`` (``trainers/config.py``: e.g. 7.0 StanfordCars, 6.0 FGVCAircraft / SUN397
/ DTD, 0.5 ImageNet / Caltech101, 0.01 and rep_dim 2048 EuroSAT) is ``adapter.reg_weight``. Their few-shot
config (``vit_b16_few_shot.yaml``): ``adapter.reg_weight=0.5 train.batch_size=32 train.epochs=50``.
Differences: the logits use the backbone's logit scale (theirs hard-code 100, CLIP ViT-B/16's learned
scale); representation layers are counted from the end of each tower (theirs are layer numbers, the same
for ViT-B/16's two 12-layer towers).
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
from fewclip.adapters._deep import encode_image_deep, encode_text_inserted, linear_init, normal, text_lower_blocks, vision_transformer
from fewclip.adapters._family import text_output_dim, zero_shot_points
from fewclip.adapters._text import TextTower, pad_sequences
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class MMRLConfig(AdapterConfig):
    name: str = field(default="mmrl", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_rep_tokens: int = field(default=5, metadata={"help": "representation tokens (their N_REP_TOKENS)"})
    rep_dim: int = field(default=512, metadata={"help": "width of the representation space (their REP_DIM)"})
    rep_depth: int = field(default=7, metadata={"help": "the last rep_depth layers of each tower get the tokens "
                                                        "(their REP_LAYERS 6..12 of ViT-B/16)"})
    alpha: float = field(default=0.7, metadata={"help": "weight of the class-token logits against the "
                                                        "representation logits (their ALPHA)"})
    reg_weight: float = field(default=1.0, metadata={"help": "weight of each consistency term (their REG_WEIGHT; "
                                                             "per dataset in their trainers/config.py)"})
    init_std: float = field(default=0.02, metadata={"help": "std of the representation tokens' init"})
    checkpointing: bool = field(default=False, metadata={"help": "recompute the towers' blocks in the backward "
                                                                 "pass (less memory)"})

    def __post_init__(self) -> None:
        for key in ("n_rep_tokens", "rep_dim", "rep_depth"):
            if getattr(self, key) < 1:
                raise ValueError(f"adapter.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"adapter.alpha must be in [0, 1], got {self.alpha}")
        if self.reg_weight < 0:
            raise ValueError(f"adapter.reg_weight must be >= 0, got {self.reg_weight}")
        if self.init_std <= 0:
            raise ValueError(f"adapter.init_std must be > 0, got {self.init_std}")


class MMRL(Adapter):
    name = "mmrl"
    uses_text_tower = True
    trains_image_tower = True
    supports_new_classes = True
    wants_frozen_features = True
    # configs/trainers/MMRL/vit_b16.yaml (AdamW, weight decay 5e-4, warm-up 1 epoch at 1e-5, RRCROP 0.5-1)
    train_defaults = {"optimizer": "adamw", "lr": 0.001, "epochs": 10, "batch_size": 4, "crop_scale_min": 0.5}

    def __init__(self, cfg: MMRLConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None, fused: bool = True):
        super().__init__(cfg, backbone, classnames, templates)
        if not self.classnames:
            raise AdapterError("adapter 'mmrl' needs at least one class name")
        if not self.templates:
            raise AdapterError("adapter 'mmrl' puts the class names in the dataset's hand-crafted template and needs "
                               "it; give the dataset's templates (data.templates=single, as the authors)")
        generator = default_generator(generator)
        device = backbone.device
        tower = TextTower(backbone.model, backbone.tokenizer)
        self.keep_outside("tower", tower)
        visual = vision_transformer(backbone.model, "adapter 'mmrl'")
        self.fused = bool(fused)  # the trained classes: fused logits; other class names: class token only
        self.template = self.templates[0]
        # the class prompts: the template's words before and after the name, no learnable context
        head, _, tail = self.template.partition("{}")
        ids = [tower.encode_words(f"{head}{c}{tail}") for c in self.classnames]
        seqs = [tower.prompt_ends().start + s + tower.prompt_ends().end for s in ids]
        if max(len(s) for s in seqs) > tower.context_length:
            raise AdapterError(f"a class prompt of template {self.template!r} has more tokens than the text tower's "
                               f"context length {tower.context_length}; shorten the class names")
        L = max(len(s) for s in seqs) if tower.can_truncate else tower.context_length
        self.register_buffer("tokens", pad_sequences(seqs, L, pad_id=tower.pad_id).to(device), persistent=False)
        self.start = len(tower.prompt_ends().start)  # the tokens go in after the start token
        Lt, Lv = len(tower.transformer.resblocks), len(visual.transformer.resblocks)
        self.depth_text, self.depth_vision = min(cfg.rep_depth, Lt), min(cfg.rep_depth, Lv)
        self.first_text, self.first_vision = Lt - self.depth_text, Lv - self.depth_vision
        Wt, Wv, D = tower.width, int(visual.class_embedding.shape[-1]), text_output_dim(tower)
        n, R = cfg.n_rep_tokens, cfg.rep_dim
        self.rep_tokens = nn.Parameter(normal((n, R), cfg.init_std, generator).to(device))
        wv, bv = linear_init(1, Wv, R, generator)  # their r2v Linear, cloned per layer
        wt, bt = linear_init(1, Wt, R, generator)  # their r2t Linear, cloned per layer
        self.to_vision_weight = nn.Parameter(wv.expand(self.depth_vision, -1, -1).contiguous().to(device))
        self.to_vision_bias = nn.Parameter(bv.expand(self.depth_vision, -1).contiguous().to(device))
        self.to_text_weight = nn.Parameter(wt.expand(self.depth_text, -1, -1).contiguous().to(device))
        self.to_text_bias = nn.Parameter(bt.expand(self.depth_text, -1).contiguous().to(device))
        self.proj_rep = nn.Parameter(normal((Wv, D), Wv ** -0.5, generator).to(device))
        self.text_mode = "truncate"  # "faithful": the full context length and every block each step (theirs)
        self._lower: Optional[torch.Tensor] = None
        self._teacher: Optional[torch.Tensor] = None

    @classmethod
    def will_train_image_tower(cls, cfg: MMRLConfig) -> bool:
        return True

    # -- towers ------------------------------------------------------------------
    def set_text_mode(self, mode: str) -> MMRL:
        """"truncate" (prompts cut to the longest, the lower blocks computed once) or "faithful" (the full context
        length, every block at every step, as the authors' code): the same features."""
        if mode not in ("truncate", "faithful"):
            raise ValueError(f"text mode must be truncate or faithful, got {mode!r}")
        self.text_mode = mode
        self._lower = None
        return self

    def _tokens(self) -> torch.Tensor:
        t = self.tokens
        if self.text_mode == "faithful" and t.shape[1] < self.tower.context_length:
            pad = torch.full((t.shape[0], self.tower.context_length - t.shape[1]), self.tower.pad_id, dtype=t.dtype,
                             device=t.device)
            t = torch.cat([t, pad], dim=1)
        return t

    def text_features(self) -> torch.Tensor:
        """Raw text features [C, D] of the class prompts with the representation tokens in the upper layers."""
        tokens = self._tokens()
        lower = self._lower
        if lower is None or lower.device != tokens.device or self.text_mode == "faithful":
            with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
                lower = text_lower_blocks(self.tower, self.tower.embed(tokens), tokens, self.first_text)
            self._lower = lower if self.text_mode == "truncate" else None
        P = torch.einsum("nr,jwr->jnw", self.rep_tokens, self.to_text_weight) + self.to_text_bias.unsqueeze(1)
        return encode_text_inserted(self.tower, lower, tokens, P, self.first_text, self.start,
                                    self.tower.placeholder_id, checkpoint=self.cfg.checkpointing)

    def vision_tokens(self) -> torch.Tensor:
        """The representation tokens in the image tower's layers [Jv, n, W_vision]."""
        return torch.einsum("nr,jwr->jnw", self.rep_tokens, self.to_vision_weight) + self.to_vision_bias.unsqueeze(1)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Class-token and representation features side by side [B, 2D] (raw)."""
        bb = self.backbone
        visual = bb.model.visual
        pooled, toks = encode_image_deep(visual, pixels.to(bb.device, bb.dtype), self.vision_tokens(),
                                         checkpoint=self.cfg.checkpointing, first=self.first_vision,
                                         return_tokens=True)
        rep = visual.ln_post(toks).mean(dim=1) @ self.proj_rep.to(toks.dtype)  # B, D
        return torch.cat([pooled.float(), rep.float()], dim=1)

    # -- logits and loss -----------------------------------------------------------
    def prototypes(self) -> torch.Tensor:
        """Class points [C, D] with the current representation tokens."""
        g = self.backbone.geometry
        return g.prototype(g.embed_text(self.text_features()).unsqueeze(1))

    def _split(self, features: torch.Tensor):
        """Class-token and representation features of [B, 2D] features; [B, D] features (any other image
        tower's, e.g. ``logits_from_features`` of an export) are class-token features without a representation
        part (None)."""
        D = self.proj_rep.shape[1]
        if features.shape[1] == D:
            return features, None
        if features.shape[1] != 2 * D:
            raise ValueError(f"mmrl scores [B, 2D] features from its own encode_images or [B, D] image features "
                             f"(D={D}), got {tuple(features.shape)}")
        return features[:, :D], features[:, D:]

    def _logits(self, features: torch.Tensor):
        g = self.backbone.geometry
        protos = self.prototypes()
        cls, rep = self._split(features)
        return g.image_logits(cls, protos), None if rep is None else g.image_logits(rep, protos), protos

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, 2D] -> [B, C]
        logits, logits_rep, _ = self._logits(features)
        if not self.fused or logits_rep is None:
            return logits
        a = self.cfg.alpha
        return a * logits + (1 - a) * logits_rep

    def teacher_text_points(self) -> torch.Tensor:
        """The frozen text tower's points [C, D] of the same template (computed once)."""
        if self._teacher is None:
            with torch.no_grad():
                self._teacher = zero_shot_points(self.backbone, self.classnames, [self.template], self.name).float()
        return self._teacher

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor,
                      frozen: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Loss terms of a batch: [B, 2D] features from ``encode_images``, labels, and the frozen image tower's
        raw features [B, D] of the same pixels (the engine's loop passes them)."""
        if frozen is None:
            raise ValueError("mmrl.training_loss needs the frozen image tower's features of the batch (frozen=); "
                             "the engine's loop passes them")
        g, cfg = self.backbone.geometry, self.cfg
        logits, logits_rep, protos = self._logits(features)
        if logits_rep is None:
            raise ValueError("mmrl trains on the [B, 2D] features of its own encode_images")
        ce, ce_rep = F.cross_entropy(logits, labels), F.cross_entropy(logits_rep, labels)
        v = g.to_linear(g.embed_image(self._split(features)[0]))
        with torch.no_grad():
            v0 = g.to_linear(g.embed_image(frozen.to(features.device).float()))
            t0 = g.to_linear(self.teacher_text_points())
        reg_image = 1 - F.cosine_similarity(v, v0, dim=1).mean()
        reg_text = 1 - F.cosine_similarity(g.to_linear(protos), t0, dim=1).mean()
        a = cfg.alpha
        loss = a * ce + (1 - a) * ce_rep + cfg.reg_weight * reg_image + cfg.reg_weight * reg_text
        return {"loss": loss, "ce": ce.detach(), "ce_rep": ce_rep.detach(), "reg_image": reg_image.detach(),
                "reg_text": reg_text.detach()}

    # -- other class names ---------------------------------------------------------
    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> MMRL:
        """Other class names (new classes, a cross-dataset or domain-shift target) get the class-token logits
        alone, as the authors score them; the learned tensors are the same."""
        if list(classnames) == self.classnames and list(templates)[:1] == self.templates[:1]:
            return self
        other = type(self)(self.cfg, self.backbone, classnames, templates or self.templates,
                           fused=list(classnames) == self.classnames)
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.to(self.backbone.device).eval()

    def for_target(self, classnames: Sequence[str], templates: Sequence[str], class_map=None) -> MMRL:
        """Any test set but the training data gets the class-token logits alone, whatever its class names: the
        authors' ``test`` (yunncheng/MMRL@27d8821 trainers/mmrl.py:421-426) fuses on the base classes (B2N), the
        few-shot task (FS) and ImageNet itself (CD), and scores ImageNet-V2 and -Sketch, which keep
        ImageNet's class names, like every other target (``cross_datasets_test.sh``: ``TASK CD``)."""
        other = type(self)(self.cfg, self.backbone, classnames, templates or self.templates, fused=False)
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.to(self.backbone.device).eval()


register_adapter("mmrl", MMRLConfig, MMRL, export=STATE)

MMRL_FEW = "yunncheng/MMRL@27d8821 configs/trainers/MMRL/vit_b16_few_shot.yaml"
register_presets(
    "mmrl",
    Preset("authors", "MMRL's base-to-novel config (configs/trainers/MMRL/vit_b16.yaml): fewclip's defaults "
                      "(tests/parity/test_dept_mmrl_coprompt_parity.py)", not_expressed=(
        "per-dataset REG_WEIGHT (yunncheng/MMRL@27d8821 trainers/config.py): set adapter.reg_weight",
        "logits at CLIP ViT-B/16's scale 100 (hard-coded); fewclip uses the backbone's logit scale")),
    Preset("fewshot", "MMRL's few-shot config", settings=(
        Setting("adapter.reg_weight", 0.5, f"{MMRL_FEW}:35", "their few-shot regulariser weight"),
        Setting("train.batch_size", 32, f"{MMRL_FEW}:3", "their few-shot batch"),
        Setting("train.epochs", 50, f"{MMRL_FEW}:19", "their few-shot epochs"),)),
)
