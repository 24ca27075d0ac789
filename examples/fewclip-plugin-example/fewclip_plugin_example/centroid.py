"""Centroid: a training-free method, each class a point between its text prototype and its images' embeddings.

A class's centroid is the backbone geometry's average of ``text_weight`` copies of the class's zero-shot
prototype and the embeddings of its few-shot training images, so it works in every geometry (the geometry's
``prototype`` is its mean: a normalised mean on the sphere, the Lorentz centroid on the hyperboloid...). With
``text_weight`` large, or no images, it is the zero-shot classifier.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.features.encode import text_prototypes


@dataclass
class CentroidConfig(AdapterConfig):
    name: str = "centroid"
    text_weight: int = field(default=4, metadata={
        "help": "copies of the zero-shot prototype averaged with a class's image embeddings (0: images only)"})

    def __post_init__(self) -> None:
        if self.text_weight < 0:
            raise ValueError(f"adapter.text_weight must be >= 0, got {self.text_weight}")


class Centroid(Adapter):
    name = "centroid"
    trained_by = "fit"

    def __init__(self, cfg: CentroidConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        zs = text_prototypes(backbone, self.classnames, self.templates)  # [C, D] geometry points
        self.register_buffer("zeroshot", zs, persistent=False)
        self.register_buffer("centroids", zs.clone())  # what fit() learns; saved and exported

    def fit(self, data) -> dict:
        geometry = self.backbone.geometry
        points = geometry.embed_image(data.train.x.to(self.centroids.device))  # [N, D]
        for c in range(len(self.classnames)):
            mine = points[data.train.y.to(points.device) == c]
            text = self.zeroshot[c:c + 1].expand(self.cfg.text_weight, -1)
            both = torch.cat([text, mine.to(text.dtype)])
            if len(both):
                self.centroids[c] = geometry.prototype(both[None])[0]
        return {"images_per_class": int(len(points) // max(1, len(self.classnames)))}

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw -> [B, C]
        return self.backbone.geometry.image_logits(features, self.centroids)


register_adapter("centroid", CentroidConfig, Centroid, export=STATE)  # fewclip's generic adapter export
