"""TCP: textual class-aware prompts, made by a meta-network from the hand-crafted class embeddings.

Yao et al., "TCP: Textual-based Class-aware Prompt tuning for Visual-Language Model", CVPR 2024; the
authors' code is ``trainers/tcp.py`` and ``trainers/clip_text/model.py`` of
htyao89/Textual-based_Class-aware_prompt_tuning. The prompt is CoOp's with the rest of the dataset's
template kept after the class name (``[start] ctx_1..ctx_4 [name] , a type of pet . [end]`` for the
template "a photo of a {}, a type of pet."). A meta-network ``Linear(D, D/4) - QuickGELU - Linear(D/4,
n_ctx * W)`` maps each class's zero-shot point (its hand-crafted embedding: the L2-normalised text feature
on the sphere, the point's coordinates in the geometry's linear space in general) to n_ctx class-aware
tokens, which *replace* the hidden states at the context positions at the input of one text block
(block 8 of ViT-B/16's 12; ``adapter.inject_layer``, by default two thirds of the depth). The loss adds
8.0 times the distance of the learned class points to the hand-crafted ones (``1 - mean_c cos`` on the
sphere, as KgCoOp; the 8.0 is hard-coded in their code, whose ``TRAINER.COOP.W`` is not used).

Defaults from ``configs/trainers/TCP/vit_b16_ep100_ctxv1.yaml`` and ``scripts/base2new_train.sh``: 4
random context vectors (std 0.02), the meta-network in PyTorch's default initialisation, Adam (L2 weight
decay 5e-4, eps 1e-3 as their README sets it) at lr 0.002, batch 32, 50 epochs (25 for ImageNet and SUN397
in their ``train.py``). The text tower runs once per batch: the class-aware tokens depend on the class only.

Start: TCP does not start at zero-shot. From the injection block on, the context positions hold the
meta-network's output, which is random at the start as in the authors' code. With
``adapter.class_weight=0`` (hidden states ``w * class tokens + (1 - w) * h``; the authors' code fixes
``w = 1``) nothing is injected and TCP is CoOp on the template's layout: from the template's own words
(``adapter.ctx_init``) it is zero-shot with that template.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from open_clip.transformer import QuickGELU

from fewclip.adapter.base import AdapterError, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import default_linear, learned_for_classnames, loss_near_teacher, text_output_dim, zero_shot_points
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.config.presets import Preset, register_presets


@dataclass
class TCPConfig(CoOpConfig):
    name: str = field(default="tcp", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=4, metadata={"help": (
        "Number of context vectors (ignored when ctx_init is given: the words decide).")})
    ctx_init: Optional[str] = field(default=None, metadata={"help": (
        'Initial words of the context; null = random init (TCP: "a photo of a" from its config).')})
    weight: float = field(default=8.0, metadata={"help": (
        "Weight of the distance to the hand-crafted class points (8.0, hard-coded in the authors' tcp.py).")})
    reduction: int = field(default=4, metadata={"help": (
        "Hidden width of the meta-network: embedding width // reduction (4 in the authors' code).")})
    inject_layer: Optional[int] = field(default=None, metadata={"help": (
        'The text block at whose input the class-aware tokens replace the context (0-based); null: two thirds of '
        "the depth, rounded down (8 of 12, as the authors' code hard-codes for ViT-B/16).")})
    class_weight: float = field(default=1.0, metadata={"help": (
        "w in w * class tokens + (1 - w) * hidden states (1.0 in the authors' code).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.weight >= 0:
            raise ValueError(f"adapter.weight must be >= 0, got {self.weight}")
        if self.reduction < 1:
            raise ValueError(f"adapter.reduction must be >= 1, got {self.reduction}")
        if self.inject_layer is not None and self.inject_layer < 0:
            raise ValueError(f"adapter.inject_layer must be >= 0 or null, got {self.inject_layer}")
        if not math.isfinite(self.class_weight):
            raise ValueError(f"adapter.class_weight must be a finite number, got {self.class_weight}")


class TCP(CoOp):
    name = "tcp"
    supports_new_classes = True
    train_defaults = {"optimizer": "adam", "lr": 0.002, "eps": 1e-3, "batch_size": 32, "epochs": 50}

    def __init__(self, cfg: TCPConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        generator = default_generator(generator)
        if not templates:
            raise AdapterError("adapter 'tcp' builds its prompts and class-aware tokens from the dataset's prompt "
                               "templates; give them (data.templates=single or ensemble)")
        super().__init__(cfg, backbone, classnames, templates, generator=generator)
        depth = len(self.tower.transformer.resblocks)
        layer = cfg.inject_layer if cfg.inject_layer is not None else max(1, 2 * depth // 3)
        if layer >= depth or (cfg.inject_layer is None and depth < 2):
            raise AdapterError(f"adapter.inject_layer={layer} is not a block of this text tower (blocks 0 .. "
                               f"{depth - 1}); TCP needs a tower of at least 2 blocks and an inject_layer below "
                               f"{depth}")
        self.inject_layer = layer
        self.text_mode = "truncate"  # the class-aware tokens differ per class: no prefix shared by all
        device = backbone.device
        self.register_buffer("teacher", zero_shot_points(backbone, self.classnames, self.templates, self.name),
                             persistent=False)  # [C, D] geometry points
        D, W = text_output_dim(self.tower), self.tower.width
        hidden = max(1, D // cfg.reduction)
        self.meta_net = nn.Sequential(OrderedDict([
            ("linear1", default_linear(D, hidden, generator)),
            ("relu", QuickGELU()),
            ("linear2", default_linear(hidden, self.n_ctx * W, generator)),
        ])).to(device)

    def prompt_suffix(self) -> str:
        """The first template's words after the class name (", a type of pet." for "a photo of a {},
        a type of pet."); its words before the name are where the context goes."""
        template = self.templates[0]
        if template.count("{}") != 1:
            raise AdapterError(f"prompt template {template!r} needs exactly one '{{}}' for the class name")
        return template.split("{}", 1)[1]

    def set_text_mode(self, mode: str) -> TCP:
        if mode == "shared":
            raise ValueError("TCP's class-aware tokens differ per class: there is no shared prefix")
        return super().set_text_mode(mode)

    def class_tokens(self) -> torch.Tensor:
        """The class-aware tokens [C, n_ctx, W]: the meta-network of each class's hand-crafted point."""
        g = self.backbone.geometry
        out = self.meta_net(g.to_linear(self.teacher).to(self.meta_net.linear1.weight.dtype))
        return out.reshape(len(self.classnames), self.n_ctx, self.tower.width)

    def text_features(self) -> torch.Tensor:
        """Raw text features [C, D]: blocks before ``inject_layer`` see the context, the rest the class-aware
        tokens in its positions."""
        x, tokens = self.prompt_embeddings(), self.tokens
        if self.text_mode == "faithful" and x.shape[1] < self.tower.context_length:
            pad = torch.full((x.shape[0], self.tower.context_length - x.shape[1]), self.tower.pad_id,
                             dtype=tokens.dtype, device=x.device)
            x, tokens = torch.cat([x, self.tower.embed(pad).to(x.dtype)], dim=1), torch.cat([tokens, pad], dim=1)
        w = self.cfg.class_weight
        if w == 0:
            return self.tower.forward(x, tokens)
        cls_tokens = self.class_tokens()
        index = self.ctx_pos.unsqueeze(-1).expand(-1, -1, x.shape[-1])  # C, n, W

        def inject(i: int, h: torch.Tensor) -> torch.Tensor:
            if i != self.inject_layer:
                return h
            new = cls_tokens.to(h.dtype) if w == 1 else w * cls_tokens.to(h.dtype) + (1 - w) * h.gather(1, index)
            return h.scatter(1, index, new)

        return self.tower.forward(x, tokens, before_block=inject)

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return loss_near_teacher(self, features, labels, self.cfg.weight)

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> TCP:
        return learned_for_classnames(self, classnames, templates, scores_with_templates=True)


register_adapter("tcp", TCPConfig, TCP, export=STATE)

register_presets(
    "tcp",
    Preset("authors", "TCP's vit_b16_ep100_ctxv1 config and base2new script: fewclip's defaults "
                      "(tests/parity/test_prompt_parity.py)", not_expressed=(
        "25 epochs for ImageNet and SUN397 (htyao89/Textual-based_Class-aware_prompt_tuning "
        "train.py): add train.epochs=25 there",
    )),
)
