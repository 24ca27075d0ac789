"""Shared by several test files (from tests/parity/test_cache_parity.py)."""
import dataclasses

import torch

from fewclip.backbones.geometry import make_geometry
from fewclip.features.encode import Features
from fewclip.runs.run import load_train_config
from fewclip.training.engine import FitData, TrainConfig
from helpers.parity import FIXTURE_ROOT, fixture_loader

FIXTURES = FIXTURE_ROOT / "cache_ref"

f64 = torch.float64

fixture = fixture_loader(FIXTURES)

class FeatureBackbone:
    """What the cache-based adapters ask of a backbone: a geometry (clip, scale 100) and a text tower, here a
    table from the class names c0, c1, ... to the fixture's text features."""

    def __init__(self, text):
        self.geometry = make_geometry("clip", logit_scale=100.0)
        self.device = torch.device("cpu")
        self.names = [f"c{i}" for i in range(len(text))]
        self.table = dict(zip(self.names, text.double()))

    def encode_text(self, texts):
        return torch.stack([self.table[t] for t in texts])

def authors_config(name, preset="authors", **sizing):
    """The method's adapter config under ``preset=authors`` (or another of the authors' presets), built as
    ``fewclip train adapter=NAME preset=authors`` builds it (``sizing``: fields the fixture's small problem sets,
    e.g. the number of epochs)."""
    cfg = load_train_config([f"adapter={name}", f"preset={preset}"]).adapter
    return dataclasses.replace(cfg, **sizing)


def reldiff(a, b):
    """max |a - b| / max |b| (printed with ``pytest -s``)."""
    a, b = a.detach().double(), b.detach().double()
    d = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    print(f"\nmax relative difference {d:.2e}", end="")
    return d


def fit_data(views, labels, val_x, val_y, shots=4):
    feats = [Features(v, labels) for v in views]
    return FitData(feats[0], feats, Features(val_x, val_y), TrainConfig(), shots, torch.Generator().manual_seed(0))
