"""Dual encoders whose image tower open_clip cannot name: a timm model built from explicit arguments.

open_clip builds a timm image tower from a model *name* only (``vision_cfg.timm_model_name``),
with timm's defaults for everything else. Checkpoints trained with other arguments cannot be
expressed that way without changing numbers while keeping every tensor shape: MERU's ViT-S
(``vit_small_mocov3_patch16_224``) has 12 heads where timm's ``vit_small_patch16_224`` has 6,
and MERU builds every timm ViT with ``norm_layer=nn.LayerNorm`` (eps 1e-5, timm's is 1e-6).
A strict load passes and the logits are wrong.

A backbone card therefore may describe the image tower itself (``image_tower``)::

    image_tower:
      timm_model: vit_small_patch16_224    # a timm model name
      timm_kwargs: {num_heads: 12, global_pool: token, class_token: true}   # passed to timm.create_model
      norm_eps: 1.0e-5                     # torch nn.LayerNorm with this eps as the norm layer
      image_size: 224
      proj_bias: false                     # the linear projection to the embedding

and fewclip builds ``TimmTowerCLIP``: that tower (open_clip's ``TimmModel`` layout,
``visual.trunk.*`` and ``visual.head.proj.*``) with open_clip's own text tower
(``text.*``, as in ``CustomTextCLIP``) and the logit scale (and bias). Nothing else
is assumed: every timm argument that differs from timm's default is in the card.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.model import _build_text_tower

IMAGE_TOWER_KEYS = {"timm_model", "timm_kwargs", "norm_eps", "image_size", "proj_bias"}


class TimmImageTower(nn.Module):
    """A timm image model without its classifier, then a linear projection to ``embed_dim``."""

    def __init__(self, spec: dict[str, Any], embed_dim: int):
        super().__init__()
        try:
            import timm  # only cards with a timm image tower (MERU's) need it: a start-up cost otherwise
        except ImportError:  # timm comes with open_clip_torch >= 3; older installs may lack it
            raise ValueError("this card's image tower is a timm model: pip install timm") from None
        unknown = sorted(set(spec) - IMAGE_TOWER_KEYS)
        if unknown:
            raise ValueError(f"image_tower has unknown keys {unknown}; allowed: {sorted(IMAGE_TOWER_KEYS)}")
        if "timm_model" not in spec or "image_size" not in spec:
            raise ValueError("image_tower needs 'timm_model' (a timm model name) and 'image_size'")
        kwargs = dict(spec.get("timm_kwargs") or {})
        for reserved in ("pretrained", "num_classes", "img_size", "norm_layer"):
            if reserved in kwargs:
                raise ValueError(f"image_tower.timm_kwargs must not set {reserved!r} (fewclip sets it: "
                                 f"no pretrained download, no classifier, image_size, norm_eps)")
        if spec.get("norm_eps") is not None:
            kwargs["norm_layer"] = partial(nn.LayerNorm, eps=float(spec["norm_eps"]))
        size = int(spec["image_size"])
        self.trunk = timm.create_model(spec["timm_model"], pretrained=False, num_classes=0, img_size=size, **kwargs)
        self.head = nn.Sequential(OrderedDict(
            proj=nn.Linear(self.trunk.num_features, embed_dim, bias=bool(spec.get("proj_bias", False)))))
        self.image_size = (size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def _open_clip_text_tower(embed_dim: int, text_cfg: dict[str, Any], quick_gelu: bool) -> nn.Module:
    # open_clip's own builder for a text tower from a text_cfg dict, so that every text_cfg key means
    # exactly what it means in open_clip. It is private API: wrapped here, once.

    return _build_text_tower(embed_dim, dict(text_cfg), quick_gelu)


class TimmTowerCLIP(nn.Module):
    """A CLIP-style dual encoder: ``TimmImageTower`` + open_clip text tower + logit scale (and bias)."""

    def __init__(self, embed_dim: int, image_tower: dict[str, Any], text_cfg: dict[str, Any],
                 quick_gelu: bool = False, init_logit_scale: float = math.log(1 / 0.07),
                 init_logit_bias: Optional[float] = None):
        super().__init__()
        self.visual = TimmImageTower(image_tower, embed_dim)
        self.text = _open_clip_text_tower(embed_dim, text_cfg, quick_gelu)
        self.logit_scale = nn.Parameter(torch.tensor(float(init_logit_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(float(init_logit_bias))) if init_logit_bias is not None else None

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.text(text)
        return F.normalize(features, dim=-1) if normalize else features
