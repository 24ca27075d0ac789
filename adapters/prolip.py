"""ProLIP: fine-tune only the image tower's last linear projection, held near the pretrained one.

Fahes et al., "Fine-tuning CLIP's Last Visual Projector: A Few-Shot Cornucopia"; defaults from the authors'
code (github.com/astra-vision/ProLIP @ b43e795, ``methods/ProLIP.py``, ``configs/base.yaml``,
``configs/experiments/few_shot_few_val.yaml``)::

    logits(x) = scale * cos(z P + b, t)        # z: [B, W] the tower's features before the projection P [W, D];
                                               # b: a ResNet's frozen bias (none on a ViT)
    loss = CE + lambda * ||P - P0||^2          # sum of squares (the authors' MSELoss(reduction="sum"))

trained full-batch on cached pre-projection features: epoch e uses augmented view ``(e + 1) mod views`` of
every training image (the authors' ``cnt``), Adam (eps 1e-4) with a cosine schedule over ``epochs`` (300)
steps. The learning rate and lambda are searched over the authors' grid (lr 1e-2 ... 1e-8, lambda 10 ... 1e-4,
0) on validation (their ``few_shot_few_val`` recipe, the one with validation images); without a search, lr
1e-5 and lambda 1 / shots (``base.yaml``: ``lambda_funct_1_N``). At P = P0 (before fit, or lr -> 0) the logits
are the zero-shot logits in every geometry (the projection's output is the tower's usual output).

Pre-projection features: the adapter's ``feature_tower`` is ``Backbone.tower_variant("preproj")``, so the
engine gives it the views, validation and test images before the projection. Those are what the feature cache and
store keep for every ViT tower (the other methods' features are derived from them: ``fewclip.features.store``), so an
image and view is encoded once for ProLIP and every other method together. A ResNet tower: below; any other tower
is refused with a message.

ResNet towers (the authors' ``VisProjRN``, their RN50 and RN101 settings): an open_clip ModifiedResNet ends in its
attention pool's output projection ``attnpool.c_proj``, a linear map with a bias (``Backbone.image_head``: P its
weight transposed, b its bias). P trains from the pretrained weight, b stays at its pretrained value (the
authors' ``bias.requires_grad = False``), and the regulariser is on the weight alone, towards the pretrained
weight, as above. The pre-projection features are the attention's output before ``c_proj``, computed as the
authors compute them (``c_proj`` replaced by an identity map and a zero bias inside the attention call). The
feature store keeps a ResNet's plain features as they are (its projection runs inside the attention pool, so they
are not derived from these), so on a ResNet ProLIP's pre-projection views and images are encoded apart from the
other methods' features: one more pass over them. fewclip's defaults there are the same as on a ViT (and as the
authors', who use one recipe for both).

Geometry: the class points are the geometry's zero-shot prototypes and the logits the geometry's logits of
``z P + b`` (the authors' ``100 * normalize(z P + b) @ t`` in the clip geometry, with the backbone's logit scale).

A fixed learning rate (``search=false``, the base-to-new preset) is an absolute Adam step, so what it does
depends on the projection's width and scale: each entry moves by about ``lr`` and the changes add up over the
fan-in, so the features move by about ``lr * sqrt(width) / std(P)`` of their size. The authors' 1e-5 was chosen
for ViT-B/16's (width 768, drawn with std 768 ** -0.5 = 0.036); on a narrower tower or a larger projection such a
run stays near zero-shot, and the search (the default) adapts the learning rate. World 2's backbones export
their projection so that the same step moves them about as far (docs/world2.md, rounds 6 and 7).

Where fewclip differs, and why:

* The search runs on fewclip's few-shot validation split (the authors' ``generate_fewshot_dataset_(shots,
  split="val")``: the same kind of split); ties of validation accuracy go to the lowest validation
  cross-entropy, ``tie_break=first`` is the authors' first maximum (lr-major, strict ``>``).
* The views are the run's shared augmented views (CoOp's crop), ``views`` of them (the authors save 300).
* The authors retrain the best (lr, lambda) from scratch; the run is deterministic, so fewclip keeps the
  searched projection itself (the same tensor).
* Precision: the authors' ``clip.load`` keeps the model in float16 on a GPU, so there the projection, its Adam
  state and the features are float16; fewclip trains in float32 (the parity fixtures ran their code in float32).
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

from fewclip.adapter.base import Adapter, AdapterConfig, AdapterError, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import TIE_BREAKS, choose, scored, text_classifier
from fewclip.config.presets import Preset, Setting, register_presets
from fewclip.utils.errors import NonFiniteError

log = logging.getLogger(__name__)


@dataclass
class ProLIPConfig(AdapterConfig):
    name: str = field(default="prolip", metadata={"help": "The method (`fewclip adapters` lists them)."})
    views: int = field(default=300, metadata={"help": "augmented views of each training image, one per epoch "
                                                      "in turn (the authors' aug_views)"})
    epochs: int = field(default=300, metadata={"help": "full-batch Adam steps (the authors' train_epoch)"})
    search: bool = field(default=True, metadata={"help": "search lr and lambda on the few-shot validation split"})
    lrs: list[float] = field(default_factory=lambda: [1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8],
                             metadata={"help": "learning rates searched (the authors' lr_list)"})
    lambdas: list[float] = field(default_factory=lambda: [10.0, 1.0, 0.1, 0.01, 0.001, 0.0001, 0.0],
                                 metadata={"help": "regulariser weights searched (the authors' lambda_list)"})
    lr: float = field(default=1e-5, metadata={"help": "learning rate without a search (the authors' lr_v)"})
    lmbda: float = field(default=-1.0, metadata={"help": "lambda without a search; -1: 1 / shots (the authors' "
                                                         "lambda_funct_1_N)"})
    eps: float = field(default=1e-4, metadata={"help": "Adam's eps (the authors')"})
    tie_break: str = field(default="loss", metadata={"help": "among equal validation accuracies: 'loss' or 'first' "
                                                             "(the authors')"})

    def __post_init__(self) -> None:
        if self.views < 1:
            raise ValueError(f"adapter.views must be >= 1, got {self.views}")
        if self.epochs < 0:
            raise ValueError(f"adapter.epochs must be >= 0, got {self.epochs}")
        if not self.lrs or any(not v > 0 for v in self.lrs):
            raise ValueError(f"adapter.lrs must be a non-empty list of values > 0, got {list(self.lrs)}")
        if not self.lambdas or any(not v >= 0 for v in self.lambdas):
            raise ValueError(f"adapter.lambdas must be a non-empty list of values >= 0, got {list(self.lambdas)}")
        if not self.lr > 0 or not self.eps > 0:
            raise ValueError(f"adapter.lr and adapter.eps must be > 0, got {self.lr}, {self.eps}")
        if not (self.lmbda >= 0 or self.lmbda == -1):
            raise ValueError(f"adapter.lmbda must be >= 0, or -1 for 1 / shots, got {self.lmbda}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"adapter.tie_break must be one of {', '.join(TIE_BREAKS)}, got {self.tie_break!r}")


def image_head(backbone):
    """``(P [W, D], b [D] or None)``: the backbone's last image projection (``Backbone.image_head``; a stand-in
    backbone with only ``image_projection`` gives a bias-free one), or None."""
    if hasattr(backbone, "image_head"):
        return backbone.image_head()
    proj = backbone.image_projection() if hasattr(backbone, "image_projection") else None
    return None if proj is None else (proj, None)


class ProLIP(Adapter):
    """The image projection, trained on pre-projection features with an L2 pull towards the pretrained one."""

    name = "prolip"
    trained_by = "fit"
    # The trained projection is the same for every class: other class names (base-to-novel's new classes, a
    # cross-dataset target) are scored by their zero-shot prototypes through it, as the authors' base-to-new
    # evaluation does (ProLIP @ b43e795, methods/ProLIP_eval.py: the saved projection, the new classes' text weights).
    supports_new_classes = True

    def __init__(self, cfg: ProLIPConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: starts at the pretrained projection
        super().__init__(cfg, backbone, classnames, templates)
        head = image_head(backbone)
        if head is None:
            raise AdapterError(f"prolip trains the image tower's last linear projection (an open_clip ViT's "
                               f"visual.proj, a ModifiedResNet's attnpool.c_proj), which backbone "
                               f"{getattr(backbone, 'name', '?')} does not have; use a ViT or ResNet backbone")
        proj, bias = head
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        self.register_buffer("initial", proj.detach().float().clone(), persistent=False)  # P0, from the backbone
        # the ResNet projection's bias [D]: frozen at the backbone's (None for a ViT's projection, which has none)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        self.projection = nn.Parameter(self.initial.clone())  # [W, D]

    def feature_tower(self):
        return self.backbone.tower_variant("preproj")

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> ProLIP:
        """The trained projection with the prototypes of other class names and templates, in eval mode."""
        if list(classnames) == self.classnames and list(templates) == self.templates:
            return self
        return self.rebuilt_for(classnames, templates)

    def logits_with(self, proj: Tensor, z: Tensor) -> Tensor:
        """The geometry's logits of pre-projection features z [B, W] through the projection [W, D] (and the
        frozen bias, a ResNet's) -> [B, C]."""
        h = z @ proj if self.bias is None else torch.addmm(self.bias.to(z.dtype), z, proj)
        return self.backbone.geometry.image_logits(h, self.prototypes.to(z.dtype))

    def forward(self, features: Tensor) -> Tensor:
        B, W = features.shape
        z = features.to(self.projection.device)
        return self.logits_with(self.projection.to(z.dtype), z)

    def fit_views(self) -> int:
        return self.cfg.views

    def train_projection(self, views: Sequence[Tensor], labels: Tensor, lr: float, lmbda: float) -> Optional[Tensor]:
        """The authors' loop from P0: epoch e on ``views[(e + 1) % len(views)]`` ([N, W] each), full batch; None
        where the loss stops being finite."""
        cfg: ProLIPConfig = self.cfg
        proj = nn.Parameter(self.initial.clone())
        opt = torch.optim.Adam([proj], lr=lr, eps=cfg.eps)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs) if cfg.epochs else None
        cnt = 0
        with torch.enable_grad():
            for _ in range(cfg.epochs):
                cnt = 0 if (cnt + 1) % len(views) == 0 else cnt + 1
                logits = self.logits_with(proj, views[cnt])
                loss = F.cross_entropy(logits, labels) + lmbda * (proj - self.initial).pow(2).sum()
                if not torch.isfinite(loss):  # diverged: no projection (a search scores it below any other)
                    return None
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        return proj.detach()

    @torch.no_grad()
    def fit(self, data) -> dict:
        """The projection trained for each (lr, lambda) of the grid; the best on validation is kept."""
        cfg: ProLIPConfig = self.cfg
        dev = self.projection.device
        views = [v.x.to(dev) for v in data.views[: cfg.views]]
        y = data.train.y.to(dev)
        vx, vy = data.val
        if not cfg.search or vy.numel() == 0:
            if cfg.search:
                log.warning("prolip: no validation images; training with lr=%g and lambda 1/shots", cfg.lr)
            lmbda = 1.0 / data.shots if cfg.lmbda == -1 else cfg.lmbda
            proj = self.train_projection(views, y, cfg.lr, lmbda)
            if proj is None:
                raise NonFiniteError(f"prolip: the training loss stopped being finite at lr {cfg.lr}; the run is "
                                     f"stopped and not recorded. Lower adapter.lr")
            self.projection.copy_(proj)
            return {"lr": cfg.lr, "lambda": lmbda, "searched": False}
        vx = vx.to(dev)
        cands, accs, losses, projs = [], [], [], []
        for lr in cfg.lrs:
            for lmbda in cfg.lambdas:
                proj = self.train_projection(views, y, lr, lmbda)
                acc, ce = scored(self.logits_with(proj, vx), vy) if proj is not None else (-1.0, math.inf)
                cands.append((lr, lmbda))
                accs.append(acc)
                losses.append(ce)
                projs.append(proj)
        i = choose(accs, losses, cfg.tie_break)
        if projs[i] is None:
            raise NonFiniteError("prolip: the training loss stopped being finite for every (lr, lambda) searched; the "
                                 "run is stopped and not recorded. Lower adapter.lrs")
        self.projection.copy_(projs[i])
        zs_acc = scored(self.logits_with(self.initial, vx), vy)[0]
        log.info("prolip: lr=%g lambda=%g (val top1 %.2f%%, zero-shot %.2f%%)", *cands[i], accs[i], zs_acc)
        return {"lr": cands[i][0], "lambda": cands[i][1], "searched": True, "val_acc": accs[i],
                "zeroshot_val_acc": zs_acc, "val_accs": accs}


register_adapter("prolip", ProLIPConfig, ProLIP, export=STATE)

register_presets(
    "prolip",
    Preset("authors", "ProLIP's released code (methods/ProLIP.py, configs/experiments/few_shot_few_val.yaml)",
           settings=(Setting("adapter.tie_break", "first", "astra-vision/ProLIP@b43e795 methods/ProLIP.py:133",
                             "their search keeps the first best (lr, lambda) (strict >); fewclip the lowest "
                             "validation loss"),)),
    Preset("base2new", "ProLIP's base-to-new config (configs/experiments/base_to_new_VITB16.yaml)", settings=(
        Setting("adapter.search", False, "astra-vision/ProLIP@b43e795 configs/experiments/base_to_new_VITB16.yaml:15",
                "their base-to-new runs search nothing: lr 1e-5 and lambda 1 / shots (lr_v, lambda_funct_1_N), "
                "fewclip's values without a search; fewclip searches on validation by default"),)),
)
