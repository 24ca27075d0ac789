"""Shared by several test files (from tests/test_cache_parity.py)."""
import dataclasses
import torch
from fewclip.backbones.geometry import make_geometry
from fewclip.runs.run import load_train_config
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
