"""Shared by several test files (from tests/test_coop.py)."""
import copy
import math

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from fewclip.backbones.backbone import BackboneConfig, build_open_clip_model, load_backbone

POSITIONS = ["end", "middle", "front"]

TOY_BACKBONES = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]  # clip, euclidean_sq, hyperbolic, sigmoid

SHAPES = ["circle", "square", "triangle", "diamond", "cross", "star", "ring", "crescent"]  # toy-shapes classes

CLASSNAMES = ["cat", "dog", "golden retriever"]  # "golden retriever": two tokens, so prompts differ in length

CONTEXT = 16  # context length of the tiny random towers

# Geometries with no shipped toy backbone get a tiny random open_clip card with CLIP's BPE tokenizer.
CARD_GEOMETRIES = {
    "elliptic": {"name": "elliptic"},
    "euclidean": {"name": "euclidean"},
    "hyperbolic_sq": {"name": "hyperbolic_sq", "curvature": 0.5, "alpha_image": 0.3, "alpha_text": 0.3},
}

SIGLIP_TEXT = "siglip-text"  # CustomTextCLIP tower: bidirectional attention, pooled at the last position

def tiny_model_config(custom_text: bool = False, **text_cfg) -> dict:
    return {
        **({"custom_text": True} if custom_text else {}),
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16,
                       "mlp_ratio": 2.0},
        "text_cfg": {"context_length": CONTEXT, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1,
                     "mlp_ratio": 2.0, **text_cfg},
    }

def write_card(folder, name: str, model_cfg: dict, geometry: dict, seed: int = 0) -> str:
    """A random-init open_clip model saved as safetensors plus a card using open_clip's BPE tokenizer."""
    torch.manual_seed(seed)
    model = build_open_clip_model(copy.deepcopy(model_cfg))
    # The weights hold the card's logit scale, as a trained checkpoint does (fewclip checks that they agree).
    geometry = {"logit_scale": float(model.logit_scale.detach().exp()), **geometry}
    model.logit_scale.data.fill_(math.log(geometry["logit_scale"]))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / f"{name}.safetensors"))
    card = {"name": name, "model_config": model_cfg, "weights": f"{name}.safetensors",
            "tokenizer": {"type": "open_clip"}, "geometry": geometry}
    path = folder / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(card)))
    return str(path)

@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("coop_cards")
    out = {g: write_card(folder, f"tiny-{g}", tiny_model_config(), geom) for g, geom in CARD_GEOMETRIES.items()}
    out[SIGLIP_TEXT] = write_card(
        folder, "tiny-siglip-text", tiny_model_config(custom_text=True, no_causal_mask=True, pool_type="last"),
        {"name": "sigmoid", "logit_scale": 10.0, "logit_bias": -5.0})
    return out

_LOADED = {}

def backbone(name: str, cards=None):
    """Load once per test module: a shipped toy backbone, a tiny card (by geometry key) or ViT-B-32."""
    if name not in _LOADED:
        if name == "ViT-B-32":
            torch.manual_seed(0)
            cfg = BackboneConfig(name="ViT-B-32", pretrained="none", device="cpu")
        else:
            cfg = BackboneConfig(name=(cards or {}).get(name, name), device="cpu")
        _LOADED[name] = load_backbone(cfg)
    return _LOADED[name]

def image_features(bb, n: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return bb.encode_images(torch.randn(n, 3, bb.image_size, bb.image_size, generator=g))  # [n, D] raw

def classes_for(name: str):
    return SHAPES if name.startswith("toy-") else CLASSNAMES
