"""Tiny checkpoints in each author's exact file layout, regenerated from a seed (no weight files stored).

Used by the import tests and, at development time, by the scripts that ran the authors' own
code on the same files to record ``tests/fixtures/import_*.json`` (their code is not in
this repository and not needed by the tests). Depends on torch, numpy and PIL (``openai_archive``
also on open_clip).

- MERU / HyCoCLIP (facebookresearch/meru ``CheckpointManager``): ``{"model": state_dict,
  "optimizer", "scheduler", "scaler", "iteration"}``; timm ViT keys under ``visual.``, MERU's
  text encoder under ``textual.`` (with its persistent boolean ``attn_mask``), bias-free
  ``visual_proj`` / ``textual_proj``, ``logit_scale``, ``curv``, ``visual_alpha``,
  ``textual_alpha`` as logs, ``pixel_mean`` / ``pixel_std`` buffers of shape [3, 1, 1].
- EuCLIP (open_clip_train in the paper's fork): ``{"epoch", "name", "state_dict", "optimizer"}``
  with ``module.`` prefixes; open_clip key names; ``alpha_img``, ``alpha_txt``, ``curvature``
  as logs for hyperbolic runs; no final LayerNorms.
- OpenAI: ``tiny_clip.tiny_openai_state_dict`` in float16, as OpenAI's files are.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch

from helpers.tiny_clip import CONFIG as OPENAI_CONFIG
from helpers.tiny_clip import tiny_openai_state_dict

CLASSNAMES = ["cat", "dog", "golden retriever", "red car", "photo"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}.", "itap of a {}."]

# MERU's ViT for the tiny checkpoints: timm's vit_small_patch16_224 with these arguments (4 heads of 16).
MERU_VIT = dict(patch_size=8, embed_dim=64, depth=2, num_heads=4)
MERU_IMPORT_OPTIONS = {"arch": "vit_small_patch16_224", **{f"vit.{k}": str(v) for k, v in MERU_VIT.items()}}
MERU_TEXT = dict(width=128, layers=2, context_length=77, vocab_size=49408)  # L2_W128: 2 heads by MERU's rule
MERU_EMBED = 64
MERU_IMAGE = 32


def tiny_images(n: int = 4, seed: int = 1):
    """``n`` RGB PIL images of 48x40 pixels (resized and cropped to 32 by both pipelines)."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    base = rng.randint(0, 256, size=(n, 1, 1, 3))
    noise = rng.randint(-60, 61, size=(n, 40, 48, 3))
    grad = np.linspace(0, 80, 48)[None, None, :, None].astype(int)
    arr = np.clip(base + noise + grad, 0, 255).astype(np.uint8)
    return [Image.fromarray(a, "RGB") for a in arr]


def _randn(g: torch.Generator, *shape, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def tiny_meru_state_dict(seed: int = 0, hyperbolic: bool = True) -> OrderedDict[str, torch.Tensor]:
    """A MERU (or, ``hyperbolic=False``, MERU's CLIP baseline) state dict with random weights."""
    g = torch.Generator().manual_seed(seed)
    D, depth, p = MERU_VIT["embed_dim"], MERU_VIT["depth"], MERU_VIT["patch_size"]
    W, L, C, V = (MERU_TEXT[k] for k in ("width", "layers", "context_length", "vocab_size"))
    n_tok = (MERU_IMAGE // p) ** 2 + 1
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    sd["logit_scale"] = torch.tensor(4.7)  # above MERU's clamp at 4.6052
    if hyperbolic:
        sd["curv"] = torch.tensor(math.log(0.5))
        sd["visual_alpha"] = torch.tensor(math.log(0.4))
        sd["textual_alpha"] = torch.tensor(0.02)  # above 0: MERU.forward clamps it to 0 (alpha 1)
    sd["pixel_mean"] = torch.tensor((0.485, 0.456, 0.406)).view(-1, 1, 1)
    sd["pixel_std"] = torch.tensor((0.229, 0.224, 0.225)).view(-1, 1, 1)
    # timm ViT (visual.*)
    sd["visual.cls_token"] = _randn(g, 1, 1, D, std=0.5)
    sd["visual.pos_embed"] = _randn(g, 1, n_tok, D, std=0.5)
    sd["visual.patch_embed.proj.weight"] = _randn(g, D, 3, p, p, std=(3 * p * p) ** -0.5)
    sd["visual.patch_embed.proj.bias"] = _randn(g, D, std=0.1)
    for i in range(depth):
        b = f"visual.blocks.{i}"
        sd[f"{b}.norm1.weight"] = 1 + _randn(g, D, std=0.1)
        sd[f"{b}.norm1.bias"] = _randn(g, D, std=0.05)
        sd[f"{b}.attn.qkv.weight"] = _randn(g, 3 * D, D, std=2 * D ** -0.5)
        sd[f"{b}.attn.qkv.bias"] = _randn(g, 3 * D, std=0.02)
        sd[f"{b}.attn.proj.weight"] = _randn(g, D, D, std=D ** -0.5)
        sd[f"{b}.attn.proj.bias"] = _randn(g, D, std=0.02)
        sd[f"{b}.norm2.weight"] = 1 + _randn(g, D, std=0.1)
        sd[f"{b}.norm2.bias"] = _randn(g, D, std=0.05)
        sd[f"{b}.mlp.fc1.weight"] = _randn(g, 4 * D, D, std=D ** -0.5)
        sd[f"{b}.mlp.fc1.bias"] = _randn(g, 4 * D, std=0.02)
        sd[f"{b}.mlp.fc2.weight"] = _randn(g, D, 4 * D, std=(4 * D) ** -0.5)
        sd[f"{b}.mlp.fc2.bias"] = _randn(g, D, std=0.02)
    sd["visual.norm.weight"] = 1 + _randn(g, D, std=0.1)
    sd["visual.norm.bias"] = _randn(g, D, std=0.05)
    # MERU's TransformerTextEncoder (textual.*)
    sd["textual.token_embed.weight"] = _randn(g, V, W, std=0.5)
    sd["textual.posit_embed"] = _randn(g, C, W, std=0.1)
    for i in range(L):
        b = f"textual.resblocks.{i}"
        sd[f"{b}.attn.in_proj_weight"] = _randn(g, 3 * W, W, std=2 * W ** -0.5)
        sd[f"{b}.attn.in_proj_bias"] = _randn(g, 3 * W, std=0.02)
        sd[f"{b}.attn.out_proj.weight"] = _randn(g, W, W, std=W ** -0.5)
        sd[f"{b}.attn.out_proj.bias"] = _randn(g, W, std=0.02)
        sd[f"{b}.ln_1.weight"] = 1 + _randn(g, W, std=0.1)
        sd[f"{b}.ln_1.bias"] = _randn(g, W, std=0.05)
        sd[f"{b}.mlp.c_fc.weight"] = _randn(g, 4 * W, W, std=W ** -0.5)
        sd[f"{b}.mlp.c_fc.bias"] = _randn(g, 4 * W, std=0.02)
        sd[f"{b}.mlp.c_proj.weight"] = _randn(g, W, 4 * W, std=(4 * W) ** -0.5)
        sd[f"{b}.mlp.c_proj.bias"] = _randn(g, W, std=0.02)
        sd[f"{b}.ln_2.weight"] = 1 + _randn(g, W, std=0.1)
        sd[f"{b}.ln_2.bias"] = _randn(g, W, std=0.05)
    sd["textual.ln_final.weight"] = 1 + _randn(g, W, std=0.1)
    sd["textual.ln_final.bias"] = _randn(g, W, std=0.05)
    sd["textual.attn_mask"] = torch.triu(torch.full((C, C), float("-inf")), diagonal=1).bool()
    # Small projections keep tangent vectors near norm 1, where trained MERU models put them.
    sd["visual_proj.weight"] = _randn(g, MERU_EMBED, D, std=0.25 * D ** -0.5)
    sd["textual_proj.weight"] = _randn(g, MERU_EMBED, W, std=0.1 * W ** -0.5)
    return sd


def _optimizer_state(seed: int) -> dict:
    """A real AdamW state dict (tensors, param groups), as training checkpoints carry."""
    w = torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(seed)))
    opt = torch.optim.AdamW([w], lr=5e-4, betas=(0.9, 0.98), weight_decay=0.2)
    w.sum().backward()
    opt.step()
    return opt.state_dict()


def meru_checkpoint(sd: dict[str, torch.Tensor], iteration: int = 120) -> dict:
    """What MERU's CheckpointManager.step writes: every checkpointable's state dict and the iteration."""
    return {
        "model": sd,
        "optimizer": _optimizer_state(1),
        "scheduler": {"tsteps": 120000, "wsteps": 4000, "base_lrs": [5e-4], "last_epoch": iteration,
                      "_step_count": iteration + 1, "_get_lr_called_within_step": False, "_last_lr": [1e-4],
                      "lr_lambdas": [None]},
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                   "_growth_tracker": 17},
        "iteration": iteration,
    }


def euclip_model_config() -> dict:
    """A model-config JSON in the EuCLIP fork's format (its ViT-*-no-final-ln configs, tiny)."""
    c = OPENAI_CONFIG
    return {
        "embed_dim": c["embed_dim"],
        "vision_cfg": {"image_size": c["image_resolution"], "layers": c["vision_layers"], "width": c["vision_width"],
                       "patch_size": c["vision_patch_size"], "head_width": 64, "final_layernorm": False},
        "text_cfg": {"context_length": c["context_length"], "vocab_size": c["vocab_size"],
                     "width": c["transformer_width"], "heads": c["transformer_heads"],
                     "layers": c["transformer_layers"], "final_layernorm": False},
    }


EUCLIP_LOG_SCALES = {"euclidean_sq": math.log(1.35), "hyperbolic": math.log(4.0), "elliptic": math.log(20.0)}


def tiny_euclip_state_dict(geometry: str, seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """The fork's CLIP without final LayerNorms, in ``geometry`` (fewclip's name), random weights."""
    sd = OrderedDict((k, v) for k, v in tiny_openai_state_dict(seed).items()
                     if not k.startswith(("visual.ln_post.", "ln_final.")))
    sd["logit_scale"] = torch.tensor(EUCLIP_LOG_SCALES[geometry])
    if geometry.startswith("hyperbolic"):
        sd["alpha_img"] = torch.tensor(math.log(0.2))
        sd["alpha_txt"] = torch.tensor(math.log(0.3))
        sd["curvature"] = torch.tensor(2.5)  # exp = 12.2: the fork's forward clamps it to 10
    return sd


def open_clip_train_checkpoint(sd: dict[str, torch.Tensor], name: str = "run", epoch: int = 3) -> dict:
    """What open_clip_train saves with DistributedDataParallel: ``module.`` keys under ``state_dict``."""
    return {"epoch": epoch, "name": name, "state_dict": OrderedDict((f"module.{k}", v) for k, v in sd.items()),
            "optimizer": _optimizer_state(2)}


def tiny_openai_fp16(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """tiny_clip's OpenAI-layout state dict in float16 (OpenAI's files are float16)."""
    return OrderedDict((k, v.half()) for k, v in tiny_openai_state_dict(seed).items())


def openai_archive(path, seed: int = 0) -> None:
    """A TorchScript archive in OpenAI's layout: a traced QuickGELU CLIP in float16 with OpenAI's key names and the
    ``input_resolution`` / ``context_length`` / ``vocab_size`` buffers of their published files (built with
    open_clip, which uses OpenAI's names)."""
    import warnings

    import open_clip

    sd = tiny_openai_fp16(seed)
    model = open_clip.model.build_model_from_openai_state_dict({k: v.clone() for k, v in sd.items()}).float().eval()
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    for k, v in (("input_resolution", 32), ("context_length", 77), ("vocab_size", 49408)):
        if hasattr(model, k):
            delattr(model, k)
        model.register_buffer(k, torch.tensor(v))
    tokens = open_clip.tokenizer.SimpleTokenizer()(["a photo"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace_module(model, {"encode_image": torch.randn(1, 3, 32, 32), "encode_text": tokens},
                                        check_trace=False)
        traced.half().save(str(path))
