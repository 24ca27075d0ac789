"""Contrastive pretraining of small CLIP models on toy-world captions.

This is how fewclip's reference backbones are made (``scripts/pretrain_reference.py``
is the thin entry point). The model is an open_clip ``CLIP``: a ViT image tower
and a causal text transformer with argmax (end-of-text) pooling, as in real
CLIP, with a word-level tokenizer over the toy world's vocabulary. The logits
and the loss come from ``fewclip.backbones.geometry``, so one loop trains every geometry:

    toy-clip     clip          symmetric InfoNCE, learnable logit scale (CLIP)
    toy-euclip   euclidean_sq  InfoNCE on -distance^2, no final LayerNorm (EuCLIP)
    toy-meru     hyperbolic    InfoNCE on -Lorentz distance, learnable curvature
                               and per-modality scales, MERU's clamps (MERU)
    toy-siglip   sigmoid       pairwise sigmoid loss, learnable scale and bias (SigLIP)

Each step draws a fresh batch from the toy world (``index = step * batch + i``),
so a run is a pure function of its config and seed on a given device.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from safetensors.torch import save as safetensors_save

import fewclip.datasets.toyworld as tw
from fewclip.backbones.backbone import build_open_clip_model, remove_final_ln, resolve_device
from fewclip.backbones.geometry import Geometry, make_geometry
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.features.encode import progress
from fewclip.utils.checksums import sha256_file
from fewclip.utils.io import atomic_write, atomic_write_text
from fewclip.utils.rng import forked_global_rng

log = logging.getLogger(__name__)

TOY_MEAN = (0.5, 0.5, 0.5)
TOY_STD = (0.25, 0.25, 0.25)

RECIPES: dict[str, dict] = {
    "toy-clip": {"geometry": "clip", "geometry_params": {"logit_scale": 1 / 0.07}, "final_ln": True},
    "toy-euclip": {"geometry": "euclidean_sq", "geometry_params": {"logit_scale": 1 / 0.07}, "final_ln": False},
    "toy-meru": {"geometry": "hyperbolic", "geometry_params": {"logit_scale": 1 / 0.07, "curvature": 1.0},
                 "final_ln": True, "alpha_from_dim": True},
    "toy-siglip": {"geometry": "sigmoid", "geometry_params": {"logit_scale": 10.0, "logit_bias": -10.0},
                   "final_ln": True},
}


@dataclass
class PretrainConfig:
    recipe: str = "toy-clip"
    seed: int = 0
    steps: int = 2400
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    embed_dim: int = 64
    width: int = 64
    vision_layers: int = 4
    text_layers: int = 3
    head_width: int = 16
    patch_size: int = 4
    context_length: int = 20
    device: str = "auto"
    # Data seed of the pretraining stream (distinct from every task's seed).
    data_seed: int = 1_000_003
    threads: Optional[int] = None
    # Processes rendering batches ahead of the training loop (0 = in the loop).
    workers: int = 1
    # "bf16": bf16 autocast on CUDA (ignored on the CPU). The shipped models were trained with "none"
    # (fp32, TF32 off), which is what makes a CPU run and a GPU run of the script agree.
    amp: str = "none"
    out: str = "fewclip/reference"
    log_every: int = 100

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
        if self.steps < 1 or self.batch_size < 2:
            raise ValueError("steps must be >= 1 and batch_size >= 2")
        if self.amp not in ("none", "bf16"):
            raise ValueError(f"amp must be 'none' or 'bf16', got {self.amp!r}")


def model_config(cfg: PretrainConfig, vocab_size: int) -> dict:
    extra = {"init_logit_bias": RECIPES[cfg.recipe]["geometry_params"]["logit_bias"]} \
        if RECIPES[cfg.recipe]["geometry"] == "sigmoid" else {}
    return {
        **extra,
        "embed_dim": cfg.embed_dim,
        "vision_cfg": {"image_size": tw.IMAGE_SIZE, "patch_size": cfg.patch_size, "width": cfg.width,
                       "layers": cfg.vision_layers, "head_width": cfg.head_width, "mlp_ratio": 4.0},
        "text_cfg": {"context_length": cfg.context_length, "vocab_size": vocab_size, "width": cfg.width,
                     "heads": cfg.width // cfg.head_width, "layers": cfg.text_layers, "mlp_ratio": 4.0,
                     "pool_type": "argmax"},
    }


def toy_tokenizer(context_length: int) -> WordTokenizer:
    return WordTokenizer(tw.vocabulary(), context_length=context_length)


def batch_tensors(step: int, batch_size: int, data_seed: int, tokenizer: WordTokenizer):
    """Images [B,3,H,W] (normalised float) and caption tokens [B,L] for one step."""
    index = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
    scene = tw.sample_scene(data_seed, index, correlation=tw.PRETRAIN_CORRELATION)
    pixels = torch.from_numpy(tw.render(scene, data_seed)).permute(0, 3, 1, 2).float().div_(255)
    mean = torch.tensor(TOY_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(TOY_STD).view(1, 3, 1, 1)
    pixels = (pixels - mean) / std
    tokens = tokenizer(tw.captions(scene, data_seed))
    return pixels, tokens


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, start: int, steps: int, batch_size: int, data_seed: int, tokenizer: WordTokenizer):
        self.start, self.steps, self.batch_size, self.data_seed, self.tokenizer = (
            start, steps, batch_size, data_seed, tokenizer)

    def __iter__(self):
        # With several DataLoader workers, worker w renders steps w, w+n, ...; the
        # loader takes batches from the workers in turn, so step order is kept.
        info = torch.utils.data.get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for s in range(self.start + wid, self.steps, n):
            yield batch_tensors(s, self.batch_size, self.data_seed, self.tokenizer)


def _param_groups(model: nn.Module, geometry: Geometry, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # CLIP's recipe: no weight decay on gains, biases, embeddings and the logit scale.
        (no_decay if p.ndim < 2 or "embedding" in name or "class_embedding" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay + [p for p in geometry.parameters() if p.requires_grad], "weight_decay": 0.0},
    ]


def pretrain(cfg: PretrainConfig):
    """Train one reference backbone. Returns (model, geometry, tokenizer, model_cfg, history)."""

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    if device.type == "cuda":  # full fp32 for reproducibility; no TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    recipe = RECIPES[cfg.recipe]
    tokenizer = toy_tokenizer(cfg.context_length)
    mcfg = model_config(cfg, tokenizer.vocab_size)
    with forked_global_rng(cfg.seed):  # open_clip initialises weights from torch's global RNG
        model = build_open_clip_model(mcfg)
    if not recipe["final_ln"]:
        remove_final_ln(model)
    # The geometry owns the logit scale (and bias); the model's own copies are
    # frozen here and overwritten with the learned values at save time.
    model.logit_scale.requires_grad_(False)
    if getattr(model, "logit_bias", None) is not None:
        model.logit_bias.requires_grad_(False)
    gparams = dict(recipe["geometry_params"])
    if recipe.get("alpha_from_dim"):
        gparams["alpha_image"] = gparams["alpha_text"] = cfg.embed_dim ** -0.5  # MERU's init
    geometry = make_geometry(recipe["geometry"], learnable=True, **gparams)
    model.to(device)
    geometry.to(device)

    opt = torch.optim.AdamW(_param_groups(model, geometry, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * t))

    loader = torch.utils.data.DataLoader(
        _Stream(0, cfg.steps, cfg.batch_size, cfg.data_seed, tokenizer), batch_size=None,
        num_workers=cfg.workers, prefetch_factor=4 if cfg.workers > 0 else None)
    history: list[dict] = []
    model.train()
    t0 = time.time()
    ema = None
    bar = progress(loader, total=cfg.steps, desc=f"pretrain {cfg.recipe}", unit="step")
    for step, (pixels, tokens) in enumerate(bar):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        pixels, tokens = pixels.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16" and device.type == "cuda"):
            img = geometry.embed_image(model.encode_image(pixels))
            txt = geometry.embed_text(model.encode_text(tokens))
            loss = geometry.contrastive_loss(img, txt)  # the geometry computes in float32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        geometry.clamp_()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": lv, "loss_ema": ema, "time_s": round(time.time() - t0, 2),
                            **{k: round(v, 5) for k, v in geometry.params().items()}})
            log.info("step %d/%d loss %.4f (ema %.4f) %s", step, cfg.steps, lv, ema,
                     " ".join(f"{k}={v:.4g}" for k, v in geometry.params().items()))
    model.eval()
    return model, geometry, tokenizer, mcfg, history



def save_weights(path: Path, sd: dict[str, torch.Tensor], name: str) -> Path:
    """Write a reference backbone's weights as safetensors, the same bytes for the same tensors on every run.

    safetensors writes its header's metadata from a hash map, in an order that changes from process to process
    (two trainings of the same weights gave files with the same tensors and different SHA-256s); here the header
    is written again with the metadata's keys sorted."""
    raw = safetensors_save(sd, metadata={"format": "pt", "fewclip": name})
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the tensor data stays 8-byte aligned
    data = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

def save_reference(cfg: PretrainConfig, model: nn.Module, geometry: Geometry, tokenizer: WordTokenizer,
                   mcfg: dict, history: list[dict], out_dir: str | Path, train_time_s: float,
                   device_name: str) -> Path:
    """Write ``<recipe>.safetensors`` (fp16), ``<recipe>.vocab.json`` and the card ``<recipe>.yaml``."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.recipe
    with torch.no_grad():  # keep open_clip's own logit scale/bias equal to the learned geometry's
        model.logit_scale.copy_(geometry.log_scale.detach().to(model.logit_scale.dtype))
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.copy_(geometry.bias.detach())
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    weights = save_weights(out / f"{name}.safetensors", sd, name)
    vocab = out / "toy-vocab.json"
    tokenizer.save(vocab)
    recipe = RECIPES[name]
    card = {
        "name": name,
        "description": f"{mcfg['vision_cfg']['layers']}-layer ViT + {mcfg['text_cfg']['layers']}-layer text "
                       f"transformer, {recipe['geometry']} geometry, pretrained on toy-world captions",
        "model_config": mcfg,
        "final_ln": recipe["final_ln"],
        "weights": weights.name,
        "sha256": sha256_file(weights),
        "tokenizer": {"type": "word", "file": vocab.name},
        "geometry": {"name": recipe["geometry"], **{k: float(v) for k, v in geometry.params().items()}},
        "preprocess": {"mean": list(TOY_MEAN), "std": list(TOY_STD)},
        "trained_with": {
            "command": f"python scripts/pretrain_reference.py recipe={name} seed={cfg.seed} steps={cfg.steps} "
                       f"batch_size={cfg.batch_size}" + (f" amp={cfg.amp}" if cfg.amp != "none" else ""),
            "device": device_name,
            "train_time_s": round(train_time_s, 1),
            "final_loss_ema": round(history[-1]["loss_ema"], 4) if history else None,
            "parameters": int(sum(p.numel() for p in model.parameters())),
        },
    }
    atomic_write_text(out / f"{name}.yaml", OmegaConf.to_yaml(OmegaConf.create(card)))
    return out / f"{name}.yaml"
