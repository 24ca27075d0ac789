"""Shared by several test files (from tests/test_cache_methods.py)."""
import torch

from fewclip.backbones.geometry import make_geometry
from fewclip.features.encode import text_prototypes
from fewclip.training.engine import FitData
from helpers.cache_parity import fit_data
from helpers.cards import CARD_GEOMETRIES, SIGLIP_TEXT, image_features

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]  # clip, euclidean_sq, hyperbolic, sigmoid

EVERY = TOY + list(CARD_GEOMETRIES) + [SIGLIP_TEXT]  # + elliptic, euclidean, hyperbolic_sq, a SigLIP text tower

NAMES = ["circle", "square", "golden retriever"]

TEMPLATES = ["a photo of a {}.", "a sketch of the {}"]  # two: prototypes average templates in the geometry

PARAMS = {"sigmoid": dict(logit_bias=-5.0), "hyperbolic": dict(curvature=0.7, alpha_image=0.3, alpha_text=0.2),
          "hyperbolic_sq": dict(curvature=1.3, alpha_image=0.2, alpha_text=0.4)}

def zero_shot(bb, feats):
    return bb.geometry.image_logits(feats, text_prototypes(bb, NAMES, TEMPLATES))


def two_view_fit_data(bb) -> FitData:
    """Six training images' features of the NAMES classes (seed 2) in two views (the second scaled by 1.1), the first
    three for validation: what the start-at-zero-shot tests of the training-free methods fit on."""
    x = image_features(bb, n=6, seed=2)
    y = torch.arange(6) % len(NAMES)
    return fit_data([x, 1.1 * x], y, x[:3], y[:3], shots=2)


class TableBackbone:
    """A geometry and a text tower that is a table of raw text features (random, 3 classes x 2 templates)."""

    def __init__(self, geometry, dim=8):
        self.geometry = make_geometry(geometry, **PARAMS.get(geometry, {}))
        self.device = torch.device("cpu")
        gen = torch.Generator().manual_seed(1)
        self.raw = 3 * torch.randn(len(NAMES), len(TEMPLATES), dim, generator=gen)
        self.table = {t.format(c): self.raw[i, j] for i, c in enumerate(NAMES) for j, t in enumerate(TEMPLATES)}

    def encode_text(self, texts):
        return torch.stack([self.table[t] for t in texts])
