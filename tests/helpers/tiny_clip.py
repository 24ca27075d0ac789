"""A tiny CLIP in OpenAI's state-dict layout, regenerated from a seed (no weight file to store).

Shared by every parity fixture: the authors' code (OpenAI's ``clip.model.build_model``,
or the authors' modified copy of it) and fewclip (``open_clip``'s
``build_model_from_openai_state_dict``) load the same tensors.

OpenAI's ``build_model`` derives the head count as ``width // 64``, so the widths
here are 128: two heads in each tower, so that a head-count mistake changes numbers.
The text tower keeps OpenAI's vocabulary (49408, for ``clip.tokenize``) and context
length 77. The image tower takes 32x32 images in 8x8 patches (16 patches + class token).

``torch.Generator`` streams on the CPU are reproducible for a fixed torch build; the
fixtures store ``state_sha256`` so that a test can tell a changed generator from a
changed model.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch

CONFIG = dict(embed_dim=64, image_resolution=32, vision_layers=2, vision_width=128, vision_patch_size=8,
              context_length=77, vocab_size=49408, transformer_width=128, transformer_heads=2,
              transformer_layers=2)


def _block(prefix: str, width: int, g: torch.Generator, sd: dict[str, torch.Tensor]) -> None:
    def randn(*shape, std):
        return torch.randn(*shape, generator=g) * std

    sd[f"{prefix}.attn.in_proj_weight"] = randn(3 * width, width, std=width ** -0.5)
    sd[f"{prefix}.attn.in_proj_bias"] = randn(3 * width, std=0.02)
    sd[f"{prefix}.attn.out_proj.weight"] = randn(width, width, std=width ** -0.5)
    sd[f"{prefix}.attn.out_proj.bias"] = randn(width, std=0.02)
    sd[f"{prefix}.ln_1.weight"] = 1 + randn(width, std=0.1)
    sd[f"{prefix}.ln_1.bias"] = randn(width, std=0.05)
    sd[f"{prefix}.mlp.c_fc.weight"] = randn(4 * width, width, std=width ** -0.5)
    sd[f"{prefix}.mlp.c_fc.bias"] = randn(4 * width, std=0.02)
    sd[f"{prefix}.mlp.c_proj.weight"] = randn(width, 4 * width, std=(4 * width) ** -0.5)
    sd[f"{prefix}.mlp.c_proj.bias"] = randn(width, std=0.02)
    sd[f"{prefix}.ln_2.weight"] = 1 + randn(width, std=0.1)
    sd[f"{prefix}.ln_2.bias"] = randn(width, std=0.05)


def tiny_openai_state_dict(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """Float32 state dict with OpenAI CLIP's key names (what ``clip.load(..., jit=False)`` reads)."""
    c = CONFIG
    g = torch.Generator().manual_seed(seed)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    vw, tw, p = c["vision_width"], c["transformer_width"], c["vision_patch_size"]
    grid = c["image_resolution"] // p

    def randn(*shape, std):
        return torch.randn(*shape, generator=g) * std

    sd["positional_embedding"] = randn(c["context_length"], tw, std=0.1)
    sd["text_projection"] = randn(tw, c["embed_dim"], std=tw ** -0.5)
    sd["logit_scale"] = torch.tensor(math.log(1 / 0.07))
    sd["visual.class_embedding"] = randn(vw, std=vw ** -0.5)
    sd["visual.positional_embedding"] = randn(grid * grid + 1, vw, std=vw ** -0.5)
    sd["visual.proj"] = randn(vw, c["embed_dim"], std=vw ** -0.5)
    sd["visual.conv1.weight"] = randn(vw, 3, p, p, std=(3 * p * p) ** -0.5)
    sd["visual.ln_pre.weight"] = 1 + randn(vw, std=0.1)
    sd["visual.ln_pre.bias"] = randn(vw, std=0.05)
    for i in range(c["vision_layers"]):
        _block(f"visual.transformer.resblocks.{i}", vw, g, sd)
    sd["visual.ln_post.weight"] = 1 + randn(vw, std=0.1)
    sd["visual.ln_post.bias"] = randn(vw, std=0.05)
    sd["token_embedding.weight"] = randn(c["vocab_size"], tw, std=0.5)
    for i in range(c["transformer_layers"]):
        _block(f"transformer.resblocks.{i}", tw, g, sd)
    sd["ln_final.weight"] = 1 + randn(tw, std=0.1)
    sd["ln_final.bias"] = randn(tw, std=0.05)
    return sd


def state_sha256(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k].detach().float().contiguous()
        h.update(k.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def tiny_images(n: int = 4, seed: int = 1) -> torch.Tensor:
    """Normalised-looking pixel tensors [n, 3, 32, 32] (already preprocessed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g)


if __name__ == "__main__":
    sd = tiny_openai_state_dict()
    print(len(sd), "tensors,", sum(v.numel() for v in sd.values()), "values, sha256", state_sha256(sd))
