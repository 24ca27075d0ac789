"""MERU and HyCoCLIP checkpoints (facebookresearch/meru; PalAvik/hycoclip).

What the authors' code saves (``meru/utils/checkpointing.py``: ``{"model": model.state_dict(),
"optimizer": ..., "scheduler": ..., "scaler": ..., "iteration": ...}``) and how it computes
(``meru/models.py``, ``meru/encoders/*.py``):

- image tower ``visual.*``: a timm ViT made by ``build_timm_vit(arch)`` with ``num_classes=0``,
  ``global_pool="token"``, a class token and ``norm_layer=nn.LayerNorm`` (eps 1e-5, where
  timm's is 1e-6); ``vit_small_mocov3_patch16_224`` is MERU's own registration of ViT-S with
  12 heads (timm's ``vit_small_patch16_224`` has 6). Head counts show in no tensor shape, so
  ``arch=`` is required. Its input is normalised *inside* the model with the stored
  ``pixel_mean`` / ``pixel_std`` buffers (ImageNet's), from pixels in [0, 1]: they become the
  card's preprocessing.
- ``visual_proj`` / ``textual_proj``: bias-free linear projections.
- text tower ``textual.*``: CLIP's pre-LN causal transformer with GELU (not QuickGELU), final
  LayerNorm, features at the end-of-text token (the largest id, ``argmax``), heads
  ``width // 64`` unless the config's ``L12_W512_A8``-style arch string says otherwise.
- ``logit_scale``, ``curv``, ``visual_alpha``, ``textual_alpha`` stored as logs; ``MERU.forward``
  clamps them before use: logit scale at most ``4.6052``, curvature within
  ``[curv_init / 10, curv_init * 10]`` (``curv_init`` is 1.0 in every released config), each
  alpha at most 1. The card gets the clamped values; the CLIP baselines trained with the same
  code (no ``curv``) get the cosine geometry.

HyCoCLIP (Pal et al., 2025) subclasses MERU without adding a parameter or changing an encoder,
and saves with the same checkpoint manager (compared file by file: ``hycoclip/models.py``,
``encoders/``, ``lorentz.py``, ``utils/checkpointing.py``): ``hycoclip`` is this format under
another name.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fewclip.backbones.backbone import read_checkpoint
from fewclip.backbones.fingerprints import identify
from fewclip.backbones.importer import CheckpointImportError, Format, Imported, register_format
from fewclip.backbones.preprocess import PreprocessConfig

# MERU's own timm registrations (meru/encoders/image_encoders.py): name -> (timm model, arguments).
MERU_VITS = {"vit_small_mocov3_patch16_224": ("vit_small_patch16_224",
                                               {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 12})}
# The image towers of the authors' released configs (meru configs/train_{meru,clip}_vit_{s,b,l}.py, the same in
# hycoclip's): ViT width -> (model.visual.arch, heads, LayerNorm eps of build_timm_vit's nn.LayerNorm).
AUTHORS_VITS = {384: ("vit_small_mocov3_patch16_224", 12, 1e-5), 768: ("vit_base_patch16_224", 12, 1e-5),
                1024: ("vit_large_patch16_224", 16, 1e-5)}
LOG_SCALE_MAX = 4.6052  # MERU.forward: "Clamp temperature such that logits are not scaled more than 100x"
NORM_EPS = 1e-5  # build_timm_vit: norm_layer=nn.LayerNorm
TEXT_BLOCK_KEYS = ("attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
                   "ln_1.weight", "ln_1.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                   "mlp.c_proj.bias", "ln_2.weight", "ln_2.bias")


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    ck = read_checkpoint(path)
    sd = ck.get("model") if isinstance(ck, dict) and isinstance(ck.get("model"), dict) else ck
    if not isinstance(sd, dict) or "textual_proj.weight" not in sd or "visual_proj.weight" not in sd:
        keys = list(ck)[:6] if isinstance(ck, dict) else type(ck).__name__
        raise CheckpointImportError(
            f"{path} is not a MERU/HyCoCLIP checkpoint: expected {{'model': state_dict, ...}} (or the bare state "
            f"dict) with visual_proj.weight and textual_proj.weight; found {keys}")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return dict(sd)


def _yaml_value(text: str) -> Any:

    return yaml.safe_load(text)


def _timm_vit(arch: str, overrides: dict[str, Any]):
    """(timm model name, keyword arguments) of MERU's ``build_timm_vit(arch)`` plus explicit overrides."""
    import timm  # only MERU/HyCoCLIP imports need it: a start-up cost otherwise

    base, kwargs = MERU_VITS.get(arch, (arch, {}))
    if not (base.startswith("vit_") and timm.is_model(base)):
        raise CheckpointImportError(
            f"arch={arch} is not a timm ViT name (MERU builds its image tower with timm.create_model(arch)); use the "
            f"config's model.visual.arch: vit_small_mocov3_patch16_224 (ViT-S), vit_base_patch16_224 (ViT-B), "
            f"vit_large_patch16_224 (ViT-L)")
    bad = sorted(set(overrides) & {"img_size", "num_classes", "norm_layer", "pretrained"})
    if bad:
        raise CheckpointImportError(f"vit.{bad[0]} cannot be set: the image size is read from the checkpoint and "
                                    f"the classifier and norm layer are MERU's")
    return base, {**kwargs, "global_pool": "token", "class_token": True, **overrides}


def _timm_heads(timm_model: str, kwargs: dict[str, Any]) -> int:
    """The head count of the timm ViT ``timm_model`` built with ``kwargs`` (on the meta device: no memory, no init)."""
    import timm  # only MERU/HyCoCLIP imports need it: a start-up cost otherwise

    with torch.device("meta"):
        vit = timm.create_model(timm_model, pretrained=False, num_classes=0, **kwargs)
    return int(vit.blocks[0].attn.num_heads)


def check_authors_vit(arch: str, timm_model: str, kwargs: dict[str, Any], width: int, options: dict[str, str],
                      path: Path) -> int:
    """The head count of the tower ``arch`` builds, checked against the authors' configuration for ``width``
    (head counts are in no tensor shape): a contradiction is an error naming the authors' arch, unless the
    heads were given explicitly (``vit.num_heads=``, a model trained with a config of one's own)."""
    heads = _timm_heads(timm_model, kwargs)
    authors = AUTHORS_VITS.get(width)
    if authors and heads != authors[1] and "vit.num_heads" not in options:
        raise CheckpointImportError(
            f"arch={arch} builds a ViT with {heads} heads, but the image tower in {path} has width {width}, and the "
            f"authors' only configuration of that width is {authors[0]} with {authors[1]} heads (MERU's and "
            f"HyCoCLIP's configs/train_*_vit_*.py); use arch={authors[0]} (or vit.num_heads=N if it was trained "
            f"with a configuration of your own)")
    return heads


def _text_heads(width: int, text_arch: str | None, layers: int) -> int:
    """MERU's TransformerTextEncoder: heads from ``A<n>`` in the arch string, else ``width // 64``."""
    if text_arch is None:
        return width // 64
    parsed = {k: int(v) for k, v in re.findall(r"([LWA])(\d+)", text_arch)}
    if parsed.get("L", layers) != layers or parsed.get("W", width) != width:
        raise CheckpointImportError(f"text_arch={text_arch} says L{parsed.get('L')}_W{parsed.get('W')}, the "
                                    f"checkpoint holds L{layers}_W{width}")
    return parsed.get("A", width // 64)


def _shortest(t: torch.Tensor) -> list:
    """The values of ``t`` as the shortest decimals that give back the same floats in ``t``'s dtype (0.485, not
    0.48500001 for a float32 buffer): the card reads as the authors wrote it, the pixels are the same."""
    dtype = {torch.float16: np.float16, torch.float32: np.float32}.get(t.dtype, np.float64)
    return [float(np.format_float_positional(dtype(float(x)), unique=True)) for x in t.reshape(-1)]


def read_meru(path: Path, options: dict[str, str]) -> Imported:
    sd = _state_dict(path)
    notes = []
    arch = options["arch"]
    overrides = {k[len("vit."):]: _yaml_value(v) for k, v in options.items() if k.startswith("vit.")}
    timm_model, timm_kwargs = _timm_vit(arch, overrides)
    try:
        curv_init = float(options.get("curv_init", 1.0))
    except ValueError:
        raise CheckpointImportError(f"curv_init must be a number, got {options['curv_init']!r}") from None
    if not curv_init > 0:
        raise CheckpointImportError(f"curv_init must be positive, got {curv_init}")

    # -- text tower: shapes from the checkpoint, heads by MERU's rule
    token = sd["textual.token_embed.weight"]
    vocab, width = token.shape
    context = sd["textual.posit_embed"].shape[0]
    layers = len({k.split(".")[2] for k in sd if k.startswith("textual.resblocks.")})
    heads = _text_heads(width, options.get("text_arch"), layers)
    mlp = sd["textual.resblocks.0.mlp.c_fc.weight"].shape[0] / width
    embed_dim = sd["textual_proj.weight"].shape[0]
    mask = sd.get("textual.attn_mask")
    if mask is not None and not torch.equal(mask.bool(), torch.ones(context, context, dtype=torch.bool).triu(1)):
        raise CheckpointImportError(f"{path}: textual.attn_mask is not MERU's causal mask")
    notes.append(f"text tower: {layers} layers, width {width}, {heads} heads "
                 f"({'from text_arch' if 'text_arch' in options else 'width // 64, MERU default'}), GELU, "
                 f"final LayerNorm, end-of-text (argmax) pooling, context {context}")

    # -- image tower: the ViT MERU builds for `arch`; the image size from the position embeddings
    patch = sd["visual.patch_embed.proj.weight"].shape[-1]
    grid = math.isqrt(sd["visual.pos_embed"].shape[1] - 1)
    image_size = int(patch * grid)
    vit_width = int(sd["visual.patch_embed.proj.weight"].shape[0])
    vit_heads = check_authors_vit(arch, timm_model, timm_kwargs, vit_width, options, path)
    known = identify(sd)
    if known is not None and known.num_heads is not None and known.num_heads != vit_heads:
        raise CheckpointImportError(
            f"{path} holds the published weights {known.name} (recognised by their fingerprint), whose image tower "
            f"has {known.num_heads} heads; arch={arch} builds {vit_heads}. Use arch={known.architecture}")
    image_tower = {"timm_model": timm_model, "timm_kwargs": timm_kwargs, "norm_eps": NORM_EPS,
                   "image_size": image_size, "proj_bias": False}
    notes.append(f"image tower: timm {timm_model} {timm_kwargs}, {vit_heads} heads, LayerNorm eps {NORM_EPS} "
                 f"(MERU's arch {arch}), {image_size}px" + (f"; recognised as {known.name}" if known else ""))

    # -- geometry: stored logs, MERU.forward's clamps
    weights: dict[str, torch.Tensor] = {}
    log_scale = sd["logit_scale"].float().reshape(())
    clamped = log_scale.clamp(max=LOG_SCALE_MAX)
    if clamped != log_scale:
        notes.append(f"logit_scale: stored log {float(log_scale):.6g} clamped to {LOG_SCALE_MAX} as MERU.forward does")
    weights["logit_scale"] = clamped.to(sd["logit_scale"].dtype)
    geometry: dict[str, Any] = {"logit_scale": math.exp(float(weights["logit_scale"].float()))}
    if "curv" in sd:
        lo, hi = math.log(curv_init / 10), math.log(curv_init * 10)
        stored = {k: float(sd[k].float()) for k in ("curv", "visual_alpha", "textual_alpha")}
        curv = min(max(stored["curv"], lo), hi)
        alphas = {k: min(stored[k], 0.0) for k in ("visual_alpha", "textual_alpha")}
        for k, v in (("curv", curv), *alphas.items()):
            if v != stored[k]:
                notes.append(f"{k}: stored log {stored[k]:.6g} clamped to {v:.6g} as MERU.forward does")
        geometry = {"name": "hyperbolic", **geometry, "curvature": math.exp(curv),
                    "alpha_image": math.exp(alphas["visual_alpha"]), "alpha_text": math.exp(alphas["textual_alpha"])}
        notes.append(f"geometry: hyperbolic (MERU), curvature/alphas/logit scale from the stored logs "
                     f"(curv_init {curv_init} for the curvature clamp)")
    else:
        geometry = {"name": "clip", **geometry}
        notes.append("geometry: clip (the CLIP baseline of MERU's code: no curv in the checkpoint)")

    # -- weights in TimmTowerCLIP's layout
    known = {"logit_scale", "curv", "visual_alpha", "textual_alpha", "pixel_mean", "pixel_std", "textual.attn_mask",
             "visual_proj.weight", "textual_proj.weight", "textual.token_embed.weight", "textual.posit_embed",
             "textual.ln_final.weight", "textual.ln_final.bias"}
    for k, v in sd.items():
        if k.startswith("visual."):
            weights[f"visual.trunk.{k[len('visual.'):]}"] = v
        elif k.startswith("textual.resblocks."):
            i, rest = k[len("textual.resblocks."):].split(".", 1)
            if rest not in TEXT_BLOCK_KEYS:
                raise CheckpointImportError(f"{path}: unexpected text-block key {k}")
            weights[f"text.transformer.resblocks.{i}.{rest}"] = v
        elif k not in known:
            raise CheckpointImportError(f"{path}: unexpected key {k} for a MERU/HyCoCLIP checkpoint")
    weights["visual.head.proj.weight"] = sd["visual_proj.weight"]
    weights["text.token_embedding.weight"] = token
    weights["text.positional_embedding"] = sd["textual.posit_embed"]
    weights["text.ln_final.weight"] = sd["textual.ln_final.weight"]
    weights["text.ln_final.bias"] = sd["textual.ln_final.bias"]
    weights["text.text_projection"] = sd["textual_proj.weight"].t()

    mean = _shortest(sd["pixel_mean"]) if "pixel_mean" in sd else [0.485, 0.456, 0.406]
    std = _shortest(sd["pixel_std"]) if "pixel_std" in sd else [0.229, 0.224, 0.225]
    pre = PreprocessConfig(size=image_size, mean=mean, std=std)  # the evaluators' Resize(BICUBIC), CenterCrop
    notes.append(f"preprocessing (MERU's evaluators, then the model's pixel_mean / pixel_std on [0, 1] pixels): "
                 f"{pre.describe()}")
    card = {
        "description": f"imported from {path.name} (MERU/HyCoCLIP layout, arch {arch})",
        "model_config": {"embed_dim": int(embed_dim),
                         "text_cfg": {"context_length": int(context), "vocab_size": int(vocab), "width": int(width),
                                      "heads": int(heads), "layers": int(layers), "mlp_ratio": float(mlp),
                                      "pool_type": "argmax"}},
        "image_tower": image_tower,
        "tokenizer": {"type": "open_clip"},  # MERU's tokenizer is CLIP's BPE with the same vocabulary
        "geometry": geometry,
        "preprocess": pre.card_section(),
    }
    return Imported(weights=weights, card=card, notes=notes)


MERU = register_format(Format(
    name="meru",
    read=read_meru,
    options={
        "arch": "the timm ViT of the training config's model.visual.arch: vit_small_mocov3_patch16_224, "
                "vit_base_patch16_224 or vit_large_patch16_224 (head counts are in no tensor shape)",
        "vit.*": "a timm ViT argument where the model was trained with another (vit.num_heads=12, vit.depth=6)",
        "text_arch": "the config's model.textual.arch (L12_W512; needed only if it has an A<heads> part)",
        "curv_init": "the config's model.curv_init, the centre of MERU's curvature clamp (1.0 in every released one)",
    },
    required=("arch",),
    summary="MERU checkpoints ({'model': state_dict, ...}; Lorentz geometry, timm ViT, CLIP BPE)",
))
register_format(replace(MERU, name="hycoclip",
                        summary="HyCoCLIP checkpoints: the same files as MERU's (HyCoCLIP subclasses MERU "
                                "without new parameters)"))
