"""OpenAI CLIP checkpoints (github.com/openai/CLIP).

OpenAI publishes TorchScript archives (``ViT-B-32.pt``, ...), read here by fewclip's tensor-only
reader (``fewclip.formats.torchscript``: no code from the archive runs); a state dict saved
from ``clip.load(..., jit=False)`` works too. Their state dicts carry ``input_resolution``,
``context_length`` and ``vocab_size`` besides the weights; OpenAI's ``build_model`` drops
them and derives the architecture from tensor shapes, heads as ``width // 64`` in both
towers (``clip/model.py``), and so does this format. The towers use QuickGELU, which no
tensor shape shows: the card's model config says ``quick_gelu: true``. Geometry: cosine,
with the stored logit scale; preprocessing: ``clip.load``'s, the shorter side to the model's
size (bicubic), a centre crop, OpenAI's mean and std.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from fewclip.backbones.backbone import OPENAI_EXTRA_KEYS, read_checkpoint
from fewclip.backbones.importer import CheckpointImportError, Format, Imported, register_format
from fewclip.backbones.preprocess import PreprocessConfig
from fewclip.backbones.torchscript import archive_prefix


def openai_model_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The open_clip model config of an OpenAI state dict, derived as OpenAI's ``build_model`` does."""
    if "visual.proj" in sd:
        width = sd["visual.conv1.weight"].shape[0]
        layers = len([k for k in sd if k.startswith("visual.") and k.endswith(".attn.in_proj_weight")])
        patch = sd["visual.conv1.weight"].shape[-1]
        grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        vision = {"image_size": int(patch * grid), "layers": int(layers), "width": int(width), "patch_size": int(patch),
                  "head_width": 64}
    else:
        layers = tuple(len({k.split(".")[2] for k in sd if k.startswith(f"visual.layer{b}")}) for b in (1, 2, 3, 4))
        width = sd["visual.layer1.0.conv1.weight"].shape[0]
        out = round((sd["visual.attnpool.positional_embedding"].shape[0] - 1) ** 0.5)
        vision = {"image_size": int(out * 32), "layers": list(layers), "width": int(width), "head_width": 64}
    text_width = sd["ln_final.weight"].shape[0]
    return {
        "embed_dim": int(sd["text_projection"].shape[1]),
        "quick_gelu": True,
        "vision_cfg": vision,
        "text_cfg": {"context_length": int(sd["positional_embedding"].shape[0]),
                     "vocab_size": int(sd["token_embedding.weight"].shape[0]), "width": int(text_width),
                     "heads": int(text_width // 64),
                     "layers": len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks")})},
    }


def read_openai(path: Path, options: dict[str, str]) -> Imported:
    ck = read_checkpoint(path)
    sd = ck["state_dict"] if isinstance(ck, dict) and isinstance(ck.get("state_dict"), dict) else ck
    if not isinstance(sd, dict) or "text_projection" not in sd or "token_embedding.weight" not in sd:
        keys = list(sd)[:6] if isinstance(sd, dict) else type(sd).__name__
        raise CheckpointImportError(f"{path} is not an OpenAI CLIP checkpoint (no text_projection / "
                                    f"token_embedding.weight); found {keys}")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    extra = [k for k in OPENAI_EXTRA_KEYS if k in sd]
    sd = {k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS}
    mask = sd.get("attn_mask")
    if mask is not None:  # a TorchScript archive keeps every buffer, an open_clip model's causal mask included
        n = mask.shape[-1]
        causal = torch.full((n, n), float("-inf")).triu(1)
        if mask.shape != (n, n) or not torch.equal(mask.float(), causal):
            raise CheckpointImportError(f"{path}: attn_mask is not the causal mask of CLIP's text tower")
        extra.append("attn_mask (the causal mask)")
        del sd["attn_mask"]
    try:
        cfg = openai_model_config(sd)
    except KeyError as e:
        raise CheckpointImportError(f"{path}: not OpenAI's CLIP layout (no {e})") from None
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    tower = (f"ViT {v['layers']} layers, width {v['width']}, patch {v['patch_size']}" if "patch_size" in v
             else f"ModifiedResNet {v['layers']}, width {v['width']}")
    kind = "a TorchScript archive (its tensors only; no code from it ran)" if archive_prefix(path) else "a state dict"
    notes = [f"read {kind}; dropped {extra or 'nothing'}",
             f"image tower: {tower}, {v['image_size']}px, heads width // 64; text: {t['layers']} layers, width "
             f"{t['width']}, {t['heads']} heads; QuickGELU in both (OpenAI's activation)",
             "geometry: clip with the stored logit scale; tokenizer: CLIP BPE",
             f"preprocessing (clip.load's): {PreprocessConfig(size=v['image_size']).describe()}"]
    card = {
        "description": f"imported from {path.name} (OpenAI CLIP)",
        "model_config": cfg,
        "tokenizer": {"type": "open_clip"},
        "geometry": {"name": "clip", "logit_scale": math.exp(float(sd["logit_scale"].float()))},
        # clip.load's _transform: Resize(n_px, BICUBIC), CenterCrop(n_px), OpenAI's mean/std = open_clip's default
        "preprocess": PreprocessConfig(size=v["image_size"]).card_section(),
    }
    return Imported(weights=sd, card=card, notes=notes)


register_format(Format(
    name="openai",
    read=read_openai,
    options={},
    summary="OpenAI CLIP: the published TorchScript .pt archives (read without running them) or their state dicts",
))
