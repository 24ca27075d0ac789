"""CLIP-SVD: fine-tune only the singular values of the towers' weight matrices.

Koleilat, Rivaz and Xiao, "Singular Value Few-shot Adaptation of Vision-Language Models" (HealthX-Lab/CLIP-SVD):
every Linear of every transformer block of both towers (attention q, k, v and output projections, both MLP
layers) is written as its SVD ``W = U diag(s) V^T``; ``U`` and ``V`` stay frozen, the singular values ``s``
(one vector per matrix, 0.04% of ViT-B/16's parameters) are learned. Their recipe (``main.py``, ``train.py``
``run_training``, ``configs/few_shot/*.yaml``): AdamW, lr 5e-4 (4e-4 in their base-to-novel configs), weight
decay 0.01, batch 32, 200 x shots iterations, cosine schedule, cross-entropy on one template per dataset.
Those are the defaults here (``train_defaults``; any can be overridden on the command line).

The decomposition is full rank (their ``round_to_nearest(min(m, n))`` is the full rank for every ViT width,
which is a multiple of 4), so with the singular values unchanged the adapted towers *are* the frozen towers
(to float rounding) and the logits are zero-shot's in every geometry. ``SVDLinear`` computes the same
product either as their chain ``(x Vh^T) * s U^T`` or by rebuilding the weight ``(U * s) Vh`` once per call,
whichever takes fewer multiply-adds for the call's number of tokens (the rebuild for more tokens than about
the width: the image tower at batch 32). The blocks' attention is split into
q/k/v Linears on a copy of the module tree (``fewclip.backbones.attention.split_attention``, as for LoRA); the
backbone is never modified.

The saved state is the singular values only. ``merged_state_dict()`` folds them back into a plain open_clip
state dict (``fewclip export RUN merge=true``, ``_towers.TOWER``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.adapter.base import AdapterConfig, register_adapter
from fewclip.adapters._towers import (  # noqa: F401
    TARGETS,
    TOWER,
    TOWERS,
    TowerWeightsAdapter,
    check_tower_targets,
    replace_module,
    shared_copy,
    target_linears,
    target_list,
    tower_blocks,
)
from fewclip.backbones.attention import pack_split_state
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class ClipSVDConfig(AdapterConfig):
    name: str = field(default="clip_svd", metadata={"help": "The method (`fewclip adapters` lists them)."})
    targets: str = field(default="q,k,v,o,mlp", metadata={
        "help": "comma list of the matrices whose singular values are learned: q, k, v, o (attention output), "
                "mlp (both MLP layers); CLIP-SVD's default is all of them"})
    towers: str = field(default="both", metadata={"help": "text, vision or both"})
    layers: str = field(default="all", metadata={
        "help": "all, first:N, last:N or a comma list of block indices, in each adapted tower (their "
                "include_train_layers: all)"})

    def __post_init__(self) -> None:
        check_tower_targets(self.targets, self.towers, self.layers)

    @property
    def target_list(self) -> list[str]:
        return target_list(self.targets)


def svd_factors(weight: torch.Tensor):
    """``U [m, r], s [r], Vh [r, n]`` of ``weight [m, n]`` in float32, r = min(m, n): ``weight = U diag(s) Vh``."""
    U, s, Vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
    return U, s, Vh


class SVDLinear(nn.Module):
    """A Linear whose weight is ``U diag(s) Vh`` with frozen singular vectors and learnable singular values
    ``s``; the bias is the original Linear's (frozen, shared)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        U, s, Vh = svd_factors(linear.weight)
        self.register_buffer("U", U, persistent=False)  # rebuilt from the backbone, never saved
        self.register_buffer("Vh", Vh, persistent=False)
        self.s = nn.Parameter(s)
        object.__setattr__(self, "bias", linear.bias)  # the backbone's tensor, not one of ours

    @property
    def weight(self) -> torch.Tensor:  # [m, n]; a property, as open_clip reads ``mlp.c_fc.weight.dtype``
        return (self.U * self.s) @ self.Vh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        cast = not torch.is_autocast_enabled()
        if cast and bias is not None:
            bias = bias.to(x.dtype)
        (m, r), n = self.U.shape, self.Vh.shape[1]
        tokens = x.numel() // max(x.shape[-1], 1)
        if r * m * n + tokens * m * n < tokens * r * (m + n):  # fewer multiply-adds: rebuild the weight once
            w = self.weight
            return F.linear(x, w.to(x.dtype) if cast else w, bias)
        # few tokens: their chain x Vh^T * s U^T (the same product, fewer multiply-adds)
        U, s, Vh = (t.to(x.dtype) for t in (self.U, self.s, self.Vh)) if cast else (self.U, self.s, self.Vh)
        return F.linear(F.linear(x, Vh) * s, U, bias)


def svd_target_modules(model: nn.Module, cfg: ClipSVDConfig) -> list[str]:
    """Split the targeted blocks' attention (in place, on a copy) and list the full names of the Linears whose
    singular values are learned."""
    return target_linears(model, cfg.towers, cfg.layers, cfg.target_list, "CLIP-SVD")


class ClipSVD(TowerWeightsAdapter):
    name = "clip_svd"
    # CLIP-SVD's recipe (module docstring) instead of CoOp's.
    train_defaults = {"optimizer": "adamw", "lr": 5e-4, "weight_decay": 1e-2, "warmup_epochs": 0,
                      "iterations_per_shot": 200}

    def __init__(self, cfg: ClipSVDConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):  # nothing random: the factors come from the weights
        model = shared_copy(backbone.model)
        targets = svd_target_modules(model, cfg)
        super().__init__(cfg, backbone, classnames, templates, model, adapts_text=cfg.towers in ("text", "both"),
                         trains_image_tower=self.will_train_image_tower(cfg))
        self.svd = nn.ModuleDict()
        for n in targets:
            layer = SVDLinear(model.get_submodule(n)).to(backbone.device)
            replace_module(model, n, layer)
            self.svd[n.replace(".", "__")] = layer

    @classmethod
    def will_train_image_tower(cls, cfg: ClipSVDConfig) -> bool:
        return cfg.towers in ("vision", "both")

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The backbone's open_clip state dict with ``U diag(s) Vh`` as the adapted weights (same keys)."""
        sd = {k: v for k, v in self.model.state_dict().items()}
        with torch.no_grad():
            for key, layer in self.svd.items():
                n = key.replace("__", ".")
                sd[f"{n}.weight"] = layer.weight
                if layer.bias is not None:
                    sd[f"{n}.bias"] = layer.bias
        sd = {k: v for k, v in sd.items() if not k.endswith((".U", ".Vh", ".s"))}
        return self._check_merged(pack_split_state(sd))


register_adapter("clip_svd", ClipSVDConfig, ClipSVD, export=TOWER)

register_presets(
    "clip_svd",
    Preset("authors", "CLIP-SVD's few-shot configs (configs/few_shot/*.yaml): fewclip's defaults "
                      "(tests/parity/test_clip_svd_2sfs_parity.py)"),
    Preset("base2new", "CLIP-SVD's base-to-novel configs", settings=(
        Setting("train.lr", 4e-4, "HealthX-Lab/CLIP-SVD@022b1ed configs/base2new/imagenet.yaml:2",
                "their base-to-novel learning rate (every dataset)"),),
        not_expressed=("train_epochs per dataset (HealthX-Lab/CLIP-SVD@022b1ed configs/base2new/<dataset>.yaml:3, "
                       "e.g. 10 ImageNet, 20 DTD): set train.epochs",)),
)
