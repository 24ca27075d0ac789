"""Shared by several test files (from tests/test_device_audit.py)."""
import pytest

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from helpers.cards import CARD_GEOMETRIES, tiny_model_config, write_card

REFERENCE = {"clip": "toy-clip", "euclidean_sq": "toy-euclip", "hyperbolic": "toy-meru", "sigmoid": "toy-siglip"}

GEOMETRY_NAMES = sorted(set(REFERENCE) | set(CARD_GEOMETRIES))

CLASSNAMES = ["circle", "square", "golden retriever"]

TEMPLATES = ["a photo of a {}.", "a drawing of a {}."]

@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit_cards")
    cfg = tiny_model_config(context_length=32)  # room for the default 16 context tokens and two-word names
    cfg["vision_cfg"]["layers"] = cfg["text_cfg"]["layers"] = 2
    names = {**REFERENCE, **{g: write_card(folder, f"tiny-{g}", cfg, geom) for g, geom in CARD_GEOMETRIES.items()}}
    return {g: load_backbone(BackboneConfig(name=n, device="cpu")) for g, n in names.items()}
