"""The adapter interface and registry.

An adapter is the trainable part of a few-shot method on top of a frozen
``Backbone``. It maps *raw image-tower features* ``[B, D]`` to class logits
``[B, C]`` in the backbone's geometry. All its trainable tensors live in the
adapter itself (the backbone is frozen and is not a registered submodule of the
adapter's state), so ``adapter_state_dict()`` holds adapter tensors only.

Two kinds of training exist:

* gradient adapters (CoOp, the zero-shot-initialised probe) are trained by
  the engine's loop: ``forward(features) -> logits``, cross-entropy, SGD;
* closed-form adapters (the CLIP-paper logistic-regression probe) implement
  ``fit(train_x, train_y, val_x, val_y)`` and the engine calls it instead.

``register_adapter("coop", CoOpConfig, CoOp)`` sits next to each class;
``build_adapter(cfg, backbone, classnames, templates)`` looks the name up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Type

import torch
import torch.nn as nn


class AdapterError(ValueError):
    """An adapter that cannot be built for these class names or this backbone; the message says what to change."""


@dataclass
class AdapterConfig:
    """Base of every adapter's config section; ``name`` selects the adapter."""

    name: str = "coop"


class Adapter(nn.Module):
    """Base class. Subclasses set ``name`` and implement ``forward``."""

    name: str = ""
    # True when forward() runs the text tower (so logits change with the parameters).
    uses_text_tower: bool = False
    # True when the engine should call fit() instead of running its gradient loop.
    closed_form: bool = False
    # True when the image tower itself is adapted: the engine then encodes images through
    # ``encode_images(pixels)`` (with gradients in training) instead of using cached features.
    trains_image_tower: bool = False
    # Overrides of the run's ``train`` section defaults for this adapter (e.g. its own optimiser).
    train_defaults: Dict[str, object] = {}

    def __init__(self, cfg: AdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str]):
        super().__init__()
        self.cfg = cfg
        # Keep the backbone out of this module's parameters and state dict.
        object.__setattr__(self, "backbone", backbone)
        self.classnames = list(classnames)
        self.templates = list(templates)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw -> [B, C]
        raise NotImplementedError

    def fit(self, train_x, train_y, val_x, val_y) -> Dict:
        raise NotImplementedError(f"adapter {self.name!r} is trained by gradient descent, not fit()")

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw image features [B, D]; adapters that train the image tower override this."""
        return self.backbone.encode_images(pixels)

    def adapter_state_dict(self) -> Dict[str, torch.Tensor]:
        """The adapter's own tensors (persistent buffers and parameters), detached, on CPU."""
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}

    def load_adapter_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.load_state_dict(sd, strict=True)

    def trainable_parameters(self) -> List[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    config_cls: Type[AdapterConfig]
    adapter_cls: Type[Adapter]


ADAPTERS: Dict[str, AdapterInfo] = {}


def register_adapter(name: str, config_cls: Type[AdapterConfig], adapter_cls: Type[Adapter]) -> None:
    if name != name.lower():
        raise ValueError(f"adapter names are lowercase, got {name!r}")
    if name in ADAPTERS:
        raise ValueError(f"adapter {name!r} is registered twice")
    ADAPTERS[name] = AdapterInfo(name, config_cls, adapter_cls)


def adapter_info(name: str) -> AdapterInfo:
    if name not in ADAPTERS:
        raise ValueError(f"unknown adapter adapter.name={name!r}; registered: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[name]


def build_adapter(cfg: AdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str]) -> Adapter:
    info = adapter_info(cfg.name)
    if not isinstance(cfg, info.config_cls):
        raise TypeError(f"adapter {cfg.name!r} needs a {info.config_cls.__name__}, got {type(cfg).__name__}")
    # In eval mode (no dropout) until the engine trains it.
    return info.adapter_cls(cfg, backbone, classnames, templates).to(backbone.device).eval()
