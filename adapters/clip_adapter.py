"""CLIP-Adapter: a bottleneck MLP on the image features, blended with them by a residual ratio.

Gao et al., "CLIP-Adapter: Better Vision-Language Models with Feature Adapters", IJCV 2023; the authors'
code (github.com/gaopengcuhk/CLIP-Adapter @ 08d07f8, ``clip_adapter.py``) is a trainer for CoOp's
codebase::

    a = relu(W2 relu(W1 x))                 # W1: [D/reduction, D], W2: [D, D/reduction], no biases
    x' = ratio * a + (1 - ratio) * x
    logits = scale * cos(x', t_c)           # t_c: the zero-shot text classifier, frozen

Defaults: ``reduction`` 4 and ``ratio`` 0.2 (hard-coded in the released forward); both linear layers start
from PyTorch's default initialisation (uniform in +-1/sqrt(fan_in)), drawn from the run's generator. The
repository carries no optimiser settings and tells the reader to follow CoOp's commands, so the adapter
trains with the engine's defaults, which are CoOp's (SGD lr 0.002, momentum 0.9, weight decay 5e-4,
cosine after one warm-up epoch at 1e-5, batch 32, 50/100/100/200/200 epochs for 1/2/4/8/16 shots), on
the run's cached augmented views; last epoch, no selection.

Geometry: the MLP and the blend act in the geometry's linear space (``to_linear`` of the embedded
features, ``fewclip.backbones.geometry``) and the result goes back with ``from_linear`` before the geometry's logits
against the zero-shot prototypes of the run's templates. In the clip geometry this is the authors'
computation: they feed the raw feature, and since both layers are bias-free and ReLU is positively
homogeneous, feeding the normalised feature scales ``a`` and ``x`` alike and the cosine does not change.
In the Euclidean geometries the MLP acts on the embedded points, in the hyperbolic ones on tangent vectors
at the origin (the point is the exponential map of the blend). With ``ratio`` 0 the logits are the
zero-shot logits, in every geometry; at the default 0.2 and a random MLP they are not.

The text side is the zero-shot classifier of any class names, so ``for_classnames`` scores new classes with
the trained MLP (base-to-novel, cross-dataset).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import text_classifier
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class ClipAdapterConfig(AdapterConfig):
    name: str = field(default="clip_adapter", metadata={"help": "The method (`fewclip adapters` lists them)."})
    reduction: int = field(default=4, metadata={"help": 'Hidden width of the MLP: D / reduction.'})
    ratio: float = field(default=0.2, metadata={"help": (
        "Weight of the MLP's output in the blend with the features (0: zero-shot).")})

    def __post_init__(self) -> None:
        if self.reduction < 1:
            raise ValueError(f"adapter.reduction must be >= 1, got {self.reduction}")
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"adapter.ratio must be in [0, 1], got {self.ratio}")


def _default_linear_init(out_features: int, in_features: int, generator: torch.Generator) -> Tensor:
    """nn.Linear's default weight init (kaiming uniform, a = sqrt(5): uniform in +-1/sqrt(fan_in)), drawn from
    ``generator``."""
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound


class ClipAdapter(Adapter):
    """A residual bottleneck MLP on image features in the geometry's linear space."""

    name = "clip_adapter"
    supports_new_classes = True

    def __init__(self, cfg: ClipAdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes
        C, D = protos.shape
        if D // cfg.reduction < 1:
            raise ValueError(f"adapter.reduction={cfg.reduction} leaves no hidden unit for {D}-d features")
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        g = default_generator(generator)
        hidden = D // cfg.reduction
        self.fc1 = nn.Parameter(_default_linear_init(hidden, D, g))  # [D/r, D]
        self.fc2 = nn.Parameter(_default_linear_init(D, hidden, g))  # [D, D/r]

    def adapted(self, features: Tensor) -> Tensor:
        """Raw image features [B, D] -> adapted points of the geometry [B, D]."""
        g = self.backbone.geometry
        v = g.to_linear(g.embed_image(features.to(self.fc1.device)))  # [B, D]
        a = F.relu(F.relu(v @ self.fc1.T) @ self.fc2.T)
        return g.from_linear(self.cfg.ratio * a + (1 - self.cfg.ratio) * v)

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        return self.backbone.geometry.logits(self.adapted(features), self.prototypes)  # [B, C]

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> ClipAdapter:
        if list(classnames) == self.classnames and list(templates) == self.templates:
            return self
        other = ClipAdapter(self.cfg, self.backbone, classnames, templates)
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.to(self.fc1.device).eval()


register_adapter("clip_adapter", ClipAdapterConfig, ClipAdapter, export=STATE)

CLAP_CFG = "jusiro/CLAP@dbdf409 configs/trainers/SGD_lr1e-1_B256_ep300.yaml"
register_presets(
    "clip_adapter",
    Preset("authors", "CLIP-Adapter's released code (clip_adapter.py), which gives no optimiser settings and points "
                      "to CoOp's; fewclip's defaults are those (tests/parity/test_cache_parity.py)"),
    Preset("clap", "CLIP-Adapter as CLAP's repository re-runs it (INIT ClipA), which many papers quote", settings=(
        Setting("train.lr", 0.1, f"{CLAP_CFG}:17", "CLAP's one config for every method"),
        Setting("train.weight_decay", 0.0, f"{CLAP_CFG}:23", "CLAP's one config for every method"),
        Setting("train.batch_size", 256, f"{CLAP_CFG}:3", "CLAP's one config for every method"),
        Setting("train.epochs", 300, f"{CLAP_CFG}:18", "CLAP's one config for every method"),),
        not_expressed=("CLAP's epoch of pooled augmented views (jusiro/CLAP@dbdf409 trainers/adapters.py:435-447)",)),
)
