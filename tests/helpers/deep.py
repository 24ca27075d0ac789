"""Shared by several test files (from tests/test_deep.py)."""
import pytest
import torch

from fewclip.backbones.backbone import backbone_config_from_dict, load_backbone
from helpers.cards import CARD_GEOMETRIES, tiny_model_config, write_card

CLASSNAMES = ["cat", "dog", "golden retriever"]

TOY = ["toy-clip", "toy-euclip", "toy-meru", "toy-siglip"]

def tiny_config(vision=None, text=None, **top) -> dict:
    cfg = tiny_model_config(**(text or {}))
    cfg["vision_cfg"].update(layers=2, **(vision or {}))
    cfg["text_cfg"]["layers"] = 2
    cfg.update(top)
    return cfg

# Tiny open_clip models (BPE tokenizer) whose towers differ in the ways deep prompting must handle.
TINY = {
    "custom-blocks": tiny_config(vision={"qk_norm": True}, text={"qk_norm": True}),  # open_clip's own Attention
    "avg-pool": tiny_config(vision={"pool_type": "avg"}),
    "avg-pool-ln-after": tiny_config(vision={"pool_type": "avg", "final_ln_after_pool": True}),
    "siglip-text": tiny_config(text={"no_causal_mask": True, "pool_type": "last"},
                               custom_text=True),
}

@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deep_cards")
    out = {k: write_card(folder, f"tiny-{k}", cfg, {"name": "clip"}) for k, cfg in TINY.items()}
    out.update({g: write_card(folder, f"tiny-{g}", tiny_config(), geom) for g, geom in CARD_GEOMETRIES.items()})
    return out

_LOADED = {}

def load(name, cards=None, **local_attention):
    key = (name, repr(sorted(local_attention.items())))
    if key not in _LOADED:
        cfg = {"name": (cards or {}).get(name, name), "device": "cpu"}
        if local_attention:
            cfg["local_attention"] = {"flex_compile": False, **local_attention}
        _LOADED[key] = load_backbone(backbone_config_from_dict(cfg))
    return _LOADED[key]

def pixels(bb, n=3, seed=0):
    return torch.randn(n, 3, bb.image_size, bb.image_size, generator=torch.Generator().manual_seed(seed))

def snapshot(bb):
    return {k: v.clone() for k, v in bb.state_dict().items()}, [type(m) for m in bb.modules()]

def unchanged(bb, snap):
    sd, types = snap
    now = bb.state_dict()
    assert now.keys() == sd.keys() and all(torch.equal(now[k], sd[k]) for k in sd)
    assert [type(m) for m in bb.modules()] == types
    assert all(not p.requires_grad and p.grad is None for p in bb.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in bb.modules()
                   if type(m).__name__ != "Attention")  # the window's hooks on custom Attention are the backbone's
