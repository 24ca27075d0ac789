"""Zero-shot: the class prototypes of the prompt templates, nothing learned (the baseline of every table).

Radford et al., 2021: every template is filled with each class name, the text
tower's outputs are embedded and averaged into one prototype per class by the
backbone's geometry (``fewclip.features.encode.text_prototypes``), and an image's
logits are the geometry's comparison of its embedding with the prototypes.
An adapter with no parameters and nothing to train (``trained_by = None``):
its runs have ``shots=0`` and no split.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.config.presets import Preset, register_presets
from fewclip.features.encode import text_prototypes


@dataclass
class ZeroShotConfig(AdapterConfig):
    name: str = field(default="zeroshot", metadata={"help": "The method (`fewclip adapters` lists them)."})


class ZeroShot(Adapter):
    name = "zeroshot"
    uses_text_tower = True
    trained_by = None
    supports_new_classes = True  # any class names: their prototypes

    def __init__(self, cfg: ZeroShotConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        # Rebuilt from the class names and templates, so not saved.
        self.register_buffer("prototypes", text_prototypes(backbone, self.classnames, self.templates),
                             persistent=False)  # [C, D] geometry points

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw -> [B, C]
        return self.backbone.geometry.image_logits(features, self.prototypes)

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> ZeroShot:
        """The zero-shot classifier of ``classnames`` with ``templates`` (this one where they are its own)."""
        if list(classnames) == self.classnames and list(templates) == self.templates:
            return self
        return self.rebuilt_for(classnames, templates)


register_adapter("zeroshot", ZeroShotConfig, ZeroShot)

register_presets(
    "zeroshot",
    Preset("authors", "CLIP's zero-shot classifier: the same computation "
                      "(tests/parity/test_prompt_parity.py's zeroshot fixture)"),
)
