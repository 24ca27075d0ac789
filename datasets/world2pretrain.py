"""Contrastive pretraining of small CLIP models on world 2 (``world2``): the ``w2-*`` reference backbones.

The same model, loss and loop as the first world's (``toypretrain``: an open_clip ViT + causal text transformer,
the geometry's contrastive loss, AdamW with a cosine schedule, fp32), on world 2's images and captions, with a
word tokenizer over world 2's vocabulary (``w2-vocab.json``). Each step draws a fresh batch
(``index = step * batch + i``), so a run is a pure function of its config and seed on a given device.

    w2-clip    clip          symmetric InfoNCE, learnable logit scale (CLIP)
    w2-euclip  euclidean_sq  InfoNCE on -distance^2, no final LayerNorm (EuCLIP)
    w2-meru    hyperbolic    InfoNCE on -Lorentz distance, learnable curvature and scales (MERU)
    w2-siglip  sigmoid       pairwise sigmoid loss, learnable scale and bias (SigLIP)
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from omegaconf import OmegaConf

import fewclip.datasets.world2 as w2
from fewclip.backbones.backbone import build_open_clip_model, remove_final_ln, resolve_device
from fewclip.backbones.geometry import Geometry, make_geometry
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.datasets.toypretrain import RECIPES as TOY_RECIPES
from fewclip.datasets.toypretrain import TOY_MEAN, TOY_STD, _param_groups, save_weights
from fewclip.utils.checksums import sha256_file
from fewclip.utils.io import atomic_write_text
from fewclip.utils.rng import forked_global_rng

log = logging.getLogger(__name__)

RECIPES: dict[str, dict] = {f"w2-{k[4:]}": v for k, v in TOY_RECIPES.items()}
VOCAB_FILE = "w2-vocab.json"

# The image projection is exported at a sixteenth of its trained scale, the final LayerNorm at sixteen times its
# own (issue 31, rounds 6 and 7): the same function, every feature the same to the last bit, but a projection that
# a method training it with the authors' absolute step size (ProLIP: Adam, lr 1e-5) moves as far, relative to the
# features, as it moves ViT-B/16's. Adam's step is about lr on every entry and the entries' changes add up over
# the projection's fan-in, so the features move by about lr * sqrt(width) / std(proj) of their size: 770 * lr for
# ViT-B/16 (width 768, proj drawn with std 768**-0.5 = 0.036), 67 * lr for world 2's towers of rounds 6-7 as
# trained (width 64, std 0.12), 1070 * lr at a sixteenth (round 6's quarter gave 270 * lr, and ProLIP gained a
# quarter of its published margin over zero-shot); the image tower shipped since round 11 is 128 wide (std 0.085
# as trained): about 2130 * lr at a sixteenth. A power of two, so that the rescaled numbers are exact.
PROJECTION_SCALE = 0.0625


@dataclass
class World2PretrainConfig:
    recipe: str = "w2-clip"
    seed: int = 0
    steps: int = 1000
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    embed_dim: int = 128  # since round 11 (issue 31): 64 before
    width: int = 128  # the image tower's width; 64 before round 11
    vision_layers: int = 4
    text_layers: int = 3
    text_width: Optional[int] = 96  # the text tower's width (64 before round 11); None: the image tower's (width)
    head_width: int = 16
    patch_size: int = 8  # 16 tokens of 8x8 pixels: a quarter of the first world's ViT cost, for CPU pretraining
    context_length: int = 24  # room for CoOp's 16 context vectors, a name and a tail; captions up to 21 words
    device: str = "cpu"
    data_seed: int = 2_000_003
    threads: Optional[int] = None
    workers: int = 0
    out: str = "fewclip/reference"
    log_every: int = 50

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
        if self.steps < 1 or self.batch_size < 2:
            raise ValueError("steps must be >= 1 and batch_size >= 2")


# always written into a card's command; any other field only where it differs from its default
_COMMAND_FIELDS = ("recipe", "seed", "steps", "batch_size")
_NOT_IN_COMMAND = ("out", "device", "log_every", "threads", "workers")  # none changes the weights


def command(cfg: World2PretrainConfig) -> str:
    """The command that remakes ``cfg``'s weights: the recipe, seed, steps and batch size, every other setting
    that differs from its default (an architecture or optimiser change), and the thread count if set."""
    default = World2PretrainConfig(recipe=cfg.recipe)
    parts = [f"{k}={getattr(cfg, k)}" for k in _COMMAND_FIELDS]
    parts += [f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg)
              if f.name not in _COMMAND_FIELDS + _NOT_IN_COMMAND and getattr(cfg, f.name) != getattr(default, f.name)]
    if cfg.threads:
        parts.append(f"threads={cfg.threads}")
    return "python scripts/pretrain_world2.py " + " ".join(parts)


def tokenizer(context_length: int = 24) -> WordTokenizer:
    return WordTokenizer(w2.vocabulary(), context_length=context_length)


def model_config(cfg: World2PretrainConfig, vocab_size: int) -> dict:
    recipe = RECIPES[cfg.recipe]
    extra = {"init_logit_bias": recipe["geometry_params"]["logit_bias"]} if recipe["geometry"] == "sigmoid" else {}
    text_width = cfg.text_width or cfg.width
    return {
        **extra,
        "embed_dim": cfg.embed_dim,
        "vision_cfg": {"image_size": w2.IMAGE_SIZE, "patch_size": cfg.patch_size, "width": cfg.width,
                       "layers": cfg.vision_layers, "head_width": cfg.head_width, "mlp_ratio": 4.0},
        "text_cfg": {"context_length": cfg.context_length, "vocab_size": vocab_size, "width": text_width,
                     "heads": text_width // cfg.head_width, "layers": cfg.text_layers, "mlp_ratio": 4.0,
                     "pool_type": "argmax"},
    }


def batch_tensors(step: int, batch_size: int, data_seed: int, tok: WordTokenizer):
    index = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
    images, caps = w2.render_pretrain(data_seed, index)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255)
    pixels = (pixels - torch.tensor(TOY_MEAN).view(1, 3, 1, 1)) / torch.tensor(TOY_STD).view(1, 3, 1, 1)
    return pixels, tok(caps)


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, steps: int, batch_size: int, data_seed: int, tok: WordTokenizer):
        self.steps, self.batch_size, self.data_seed, self.tok = steps, batch_size, data_seed, tok

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for s in range(wid, self.steps, n):
            yield batch_tensors(s, self.batch_size, self.data_seed, self.tok)


def pretrain(cfg: World2PretrainConfig):
    """Train one w2 backbone. Returns (model, geometry, tokenizer, model_cfg, history)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    recipe = RECIPES[cfg.recipe]
    tok = tokenizer(cfg.context_length)
    mcfg = model_config(cfg, tok.vocab_size)
    with forked_global_rng(cfg.seed):
        model = build_open_clip_model(mcfg)
    if not recipe["final_ln"]:
        remove_final_ln(model)
    model.logit_scale.requires_grad_(False)
    if getattr(model, "logit_bias", None) is not None:
        model.logit_bias.requires_grad_(False)
    gparams = dict(recipe["geometry_params"])
    if recipe.get("alpha_from_dim"):
        gparams["alpha_image"] = gparams["alpha_text"] = cfg.embed_dim ** -0.5
    geometry = make_geometry(recipe["geometry"], learnable=True, **gparams)
    model.to(device)
    geometry.to(device)
    opt = torch.optim.AdamW(_param_groups(model, geometry, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * t))

    loader = torch.utils.data.DataLoader(_Stream(cfg.steps, cfg.batch_size, cfg.data_seed, tok), batch_size=None,
                                         num_workers=cfg.workers, prefetch_factor=4 if cfg.workers > 0 else None)
    history: list[dict] = []
    model.train()
    t0, ema = time.time(), None
    for step, (pixels, tokens) in enumerate(loader):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        pixels, tokens = pixels.to(device), tokens.to(device)
        img = geometry.embed_image(model.encode_image(pixels))
        txt = geometry.embed_text(model.encode_text(tokens))
        loss = geometry.contrastive_loss(img, txt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        geometry.clamp_()
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise RuntimeError(f"{cfg.recipe}: the loss is {lv} at step {step}; nothing saved")
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": lv, "loss_ema": ema, "time_s": round(time.time() - t0, 2),
                            **{k: round(v, 5) for k, v in geometry.params().items()}})
            log.info("step %d/%d loss %.4f (ema %.4f) %.0f s", step, cfg.steps, lv, ema, time.time() - t0)
    model.eval()
    return model, geometry, tok, mcfg, history


def rescale_projection(sd: dict[str, torch.Tensor], scale: float = PROJECTION_SCALE) -> bool:
    """Scale the image projection by ``scale`` and the final LayerNorm's weight and bias by ``1 / scale``, in place.

    ``ln_post(x) @ proj`` is unchanged to the last bit: ``scale`` is a power of two, the LayerNorm (fp16 here) is
    multiplied exactly, and the projection is kept in float32, where its fp16 values times ``scale`` are exact
    (in fp16 the smallest entries would round). False, and nothing changed, for a tower without a final
    LayerNorm (EuCLIP's): its projection's input cannot absorb the scale without changing the function."""
    if "visual.ln_post.weight" not in sd:
        return False
    if scale <= 0 or math.log2(scale) != round(math.log2(scale)):
        raise ValueError(f"the projection's scale must be a power of two, not {scale}")
    sd["visual.proj"] = sd["visual.proj"].float() * scale
    for k in ("visual.ln_post.weight", "visual.ln_post.bias"):
        sd[k] = sd[k] / scale
    return True


def save_reference(cfg: World2PretrainConfig, model: nn.Module, geometry: Geometry, tok: WordTokenizer,
                   mcfg: dict, history: list[dict], out_dir: str | Path, train_time_s: float,
                   device_name: str) -> Path:
    """Write ``<recipe>.safetensors`` (fp16; the image projection float32, ``rescale_projection``), ``w2-vocab.json``
    and the card ``<recipe>.yaml``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.recipe
    with torch.no_grad():
        model.logit_scale.copy_(geometry.log_scale.detach().to(model.logit_scale.dtype))
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.copy_(geometry.bias.detach())
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    if not all(torch.isfinite(v).all() for v in sd.values()):
        raise RuntimeError(f"{name}: non-finite weights after fp16 conversion; nothing saved")
    rescaled = rescale_projection(sd)
    weights = save_weights(out / f"{name}.safetensors", sd, name)
    vocab = out / VOCAB_FILE
    tok.save(vocab)
    recipe = RECIPES[name]
    card = {
        "name": name,
        "description": f"{mcfg['vision_cfg']['layers']}-layer ViT + {mcfg['text_cfg']['layers']}-layer text "
                       f"transformer, {recipe['geometry']} geometry, pretrained on world 2 (610 concepts)",
        "model_config": mcfg,
        "final_ln": recipe["final_ln"],
        "weights": weights.name,
        "sha256": sha256_file(weights),
        "tokenizer": {"type": "word", "file": vocab.name},
        "geometry": {"name": recipe["geometry"], **{k: float(v) for k, v in geometry.params().items()}},
        "preprocess": {"mean": list(TOY_MEAN), "std": list(TOY_STD)},
        "trained_with": {
            "command": command(cfg),
            "device": device_name,
            "train_time_s": round(train_time_s, 1),
            "final_loss_ema": round(history[-1]["loss_ema"], 4) if history else None,
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "export": (f"visual.proj x {PROJECTION_SCALE} (float32), visual.ln_post x {1 / PROJECTION_SCALE}: "
                       "the same function" if rescaled else "as trained (no final LayerNorm to rescale)"),
        },
    }
    atomic_write_text(out / f"{name}.yaml", OmegaConf.to_yaml(OmegaConf.create(card)))
    return out / f"{name}.yaml"
