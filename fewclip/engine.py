"""The training engine: a plain loop over cached features.

The frozen image tower runs once per image *view*, not once per step: test
and validation features are computed once, training features are cached for
``train.augment_views`` augmented views (K) and epoch e uses view e mod K.
``augment_views=0`` is the faithful mode: every step encodes freshly augmented
images, as CoOp's reference code does.

Defaults follow the CoOp protocol: SGD, lr 0.002, momentum 0.9, weight decay
5e-4, cosine schedule after one warm-up epoch at a constant 1e-5, batch 32,
epochs 50/100/100/200/200 for 1/2/4/8/16 shots, RandomResizedCrop + flip.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torchvision import transforms as T

from .features import ImageItems, accuracy, extract_features, progress
from .records import NonFiniteError

log = logging.getLogger(__name__)

COOP_EPOCHS = {1: 50, 2: 100, 4: 100, 8: 200, 16: 200}


@dataclass
class TrainConfig:
    """The ``train`` section: optimisation and feature caching."""

    optimizer: str = "sgd"
    lr: float = 0.002
    momentum: float = 0.9
    weight_decay: float = 5e-4
    # null = CoOp's schedule by shots (50/100/100/200/200 for 1/2/4/8/16).
    epochs: Optional[int] = None
    # A number of optimiser steps instead of epochs: `iterations` in total, or `iterations_per_shot` x shots
    # (CLIP-LoRA: 500 x shots). The first one set wins over `epochs`.
    iterations: Optional[int] = None
    iterations_per_shot: Optional[int] = None
    warmup_epochs: int = 1
    warmup_lr: float = 1e-5
    batch_size: int = 32
    # Cached augmented views of the training images; 0 = encode every step (faithful, slow).
    augment_views: int = 8
    # RandomResizedCrop's smallest area fraction; null = the dataset's recommendation (0.08 for photos).
    crop_scale_min: Optional[float] = None
    # "last": the last epoch's model (CoOp); "val": the epoch with the best few-shot validation accuracy.
    select: str = "last"
    # Autocast on CUDA: "bf16", "fp16" or "none".
    amp: str = "bf16"

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"train.optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.select not in ("last", "val"):
            raise ValueError(f"train.select must be 'last' or 'val', got {self.select!r}")
        if self.amp not in ("bf16", "fp16", "none"):
            raise ValueError(f"train.amp must be 'bf16', 'fp16' or 'none', got {self.amp!r}")
        if self.augment_views < 0:
            raise ValueError(f"train.augment_views must be >= 0, got {self.augment_views}")
        if self.batch_size < 1:
            raise ValueError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1 or null, got {self.epochs}")
        for key in ("iterations", "iterations_per_shot"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ValueError(f"train.{key} must be >= 1 or null, got {v}")
        for key in ("lr", "momentum", "weight_decay", "warmup_lr"):
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"train.{key} must be a finite number, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.crop_scale_min is not None and not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"train.crop_scale_min must be in (0, 1], got {self.crop_scale_min}")


def epochs_for(cfg: TrainConfig, shots: int) -> int:
    if cfg.epochs is not None:
        return cfg.epochs
    for k in sorted(COOP_EPOCHS):
        if shots <= k:
            return COOP_EPOCHS[k]
    return COOP_EPOCHS[16]


def total_steps(cfg: TrainConfig, shots: int, per_epoch: int) -> int:
    """Optimiser steps of a run: iterations, iterations_per_shot x shots, or epochs x steps per epoch."""
    if cfg.iterations is not None:
        return cfg.iterations
    if cfg.iterations_per_shot is not None:
        return cfg.iterations_per_shot * shots
    return epochs_for(cfg, shots) * per_epoch


def train_transform(backbone, dataset, cfg: TrainConfig):
    """RandomResizedCrop (+ horizontal flip where the dataset allows it) and the backbone's normalisation."""
    scale_min = cfg.crop_scale_min if cfg.crop_scale_min is not None else getattr(dataset, "min_crop_scale", 0.08)
    steps = [T.RandomResizedCrop(backbone.image_size, scale=(scale_min, 1.0),
                                 interpolation=T.InterpolationMode.BICUBIC)]
    if getattr(dataset, "hflip_ok", True):
        steps.append(T.RandomHorizontalFlip())
    steps += [T.Lambda(lambda im: im.convert("RGB")), T.ToTensor(), T.Normalize(backbone.mean, backbone.std)]
    return T.Compose(steps)


def cosine_lr(step: int, total: int, warmup: int, base: float, warmup_lr: float) -> float:
    """Constant ``warmup_lr`` for the warm-up steps, then cosine from ``base`` to 0 (CoOp's ConstantWarmup + cosine)."""
    if step < warmup:
        return warmup_lr
    t = (step - warmup) / max(1, total - warmup)
    return 0.5 * base * (1 + math.cos(math.pi * t))


def _autocast(device: torch.device, amp: str):
    if device.type != "cuda" or amp == "none":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast("cuda", dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(adapter, feats: torch.Tensor, labels: torch.Tensor, classnames, batch_size: int = 4096,
             amp: str = "none") -> Dict:
    device = adapter.backbone.device
    outs = []
    with _autocast(device, amp):
        for i in range(0, len(feats), batch_size):
            outs.append(adapter(feats[i : i + batch_size].to(device)).float().cpu())
    logits = torch.cat(outs) if outs else torch.empty(0, len(classnames))
    return accuracy(logits, labels, classnames)


def cache_train_views(backbone, dataset, items, cfg: TrainConfig, seed: int, batch_size: int,
                      workers: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """K augmented views of the training images, encoded once (deterministic by seed)."""
    tf = train_transform(backbone, dataset, cfg)
    views = []
    for k in range(cfg.augment_views):
        torch.manual_seed(seed * 1000 + k)
        views.append(extract_features(backbone, dataset, items, transform=tf, batch_size=batch_size,
                                      workers=workers, desc=f"train view {k + 1}/{cfg.augment_views}"))
    return views


def train_gradient(adapter, train_views, val, classnames, cfg: TrainConfig, shots: int, seed: int,
                   encode_fn=None) -> Dict:
    """The loop for gradient adapters. ``train_views``: list of (features, labels);
    with ``encode_fn`` (faithful mode, or an adapted image tower) each batch's images are
    encoded on the fly and ``train_views`` holds a single (item indices, labels) pair instead.
    ``val``: (features, labels), a function returning them (re-encoded by an adapted image
    tower), or None."""
    device = adapter.backbone.device
    params = adapter.trainable_parameters()
    if not params:
        raise ValueError(f"adapter {adapter.name!r} has no trainable parameters")
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = len(train_views[0][1])
    per_epoch = math.ceil(n / cfg.batch_size)
    total = total_steps(cfg, shots, per_epoch)
    epochs = math.ceil(total / per_epoch)
    warmup = min(cfg.warmup_epochs * per_epoch, total)
    gen = torch.Generator().manual_seed(seed)
    best = (-1.0, None, -1)
    history = []
    step = 0
    adapter.train()
    bar = progress(range(epochs), desc=f"train {adapter.name}", unit="epoch", leave=False)
    for epoch in bar:
        feats, labels = train_views[epoch % len(train_views)]
        perm = torch.randperm(n, generator=gen)
        total_loss, seen = 0.0, 0
        for b in range(min(per_epoch, total - step)):
            idx = perm[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total, warmup, cfg.lr, cfg.warmup_lr)
            y = labels[idx].to(device)
            if encode_fn is not None and not adapter.trains_image_tower:
                x = encode_fn(idx)  # the frozen tower, in the backbone's precision (faithful mode)
            with _autocast(device, cfg.amp):
                if encode_fn is None:
                    x = feats[idx].to(device)
                elif adapter.trains_image_tower:
                    x = encode_fn(idx)  # the adapted image tower, with gradients, under autocast
                logits = adapter(x)
            loss = F.cross_entropy(logits.float(), y)
            if not torch.isfinite(loss):  # stop: nothing non-finite is trained on, saved or recorded
                raise NonFiniteError(f"the training loss became {float(loss.detach())} at step {step + 1} "
                                     f"(epoch {epoch + 1}) of {adapter.name}; the run is stopped and not recorded. "
                                     f"Lower train.lr (now {cfg.lr}) or check the data")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total_loss += float(loss.detach()) * len(idx)
            seen += len(idx)
            step += 1
        entry = {"epoch": epoch + 1, "loss": total_loss / max(seen, 1)}
        if cfg.select == "val" and val is not None:
            vx, vy = val() if callable(val) else val
            acc = evaluate(adapter, vx, vy, classnames)["top1"]
            entry["val_top1"] = acc
            if acc > best[0]:
                best = (acc, copy.deepcopy(adapter.adapter_state_dict()), epoch + 1)
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}")
    adapter.eval()
    info = {"epochs": epochs, "steps": step, "final_loss": history[-1]["loss"] if history else None,
            "loss_curve": [round(h["loss"], 5) for h in history]}
    if cfg.select == "val" and best[1] is not None:
        adapter.load_adapter_state_dict(best[1])
        info.update({"selected_epoch": best[2], "selected_val_top1": best[0]})
    return info


def fit_adapter(adapter, backbone, dataset, split, cfg: TrainConfig, *, seed: int, batch_size: int = 256,
                workers: int = 0, val_features=None) -> Dict:
    """Train ``adapter`` on the few-shot ``split``; returns training info (time, epochs, ...)."""
    t0 = time.time()
    if val_features is None and not adapter.trains_image_tower:
        val_features = extract_features(backbone, dataset, split.val, batch_size=batch_size, workers=workers,
                                        desc="val") if split.val else None
    if adapter.closed_form:
        # Closed-form probes fit on the un-augmented training features (as in the CLIP paper).
        tx, ty = extract_features(backbone, dataset, split.train, batch_size=batch_size, workers=workers,
                                  desc="train")
        vx, vy = val_features if val_features is not None else (None, None)
        info = adapter.fit(tx, ty, vx, vy) or {}
    elif cfg.augment_views == 0 or adapter.trains_image_tower:
        # Fresh augmentations every step: the faithful mode, and always when the image tower is trained.
        tf = train_transform(backbone, dataset, cfg)
        items = ImageItems(dataset, split.train, tf)
        labels = torch.tensor([it.label for it in split.train])
        torch.manual_seed(seed)

        def encode(idx):
            pixels = torch.stack([items[int(i)][0] for i in idx])
            return adapter.encode_images(pixels)

        def adapted_val():  # validation features through the adapted image tower, as it is now
            with torch.no_grad():
                adapter.eval()
                out = extract_features(backbone, dataset, split.val, batch_size=batch_size, workers=workers,
                                       desc="val", encode=adapter.encode_images)
                adapter.train()
                return out

        val = adapted_val if (adapter.trains_image_tower and split.val) else val_features
        info = train_gradient(adapter, [(torch.arange(len(labels)), labels)], val, dataset.classnames,
                              cfg, split.shots, seed, encode_fn=encode)
    else:
        views = cache_train_views(backbone, dataset, split.train, cfg, seed, batch_size, workers)
        info = train_gradient(adapter, views, val_features, dataset.classnames, cfg, split.shots, seed)
    info["train_time_s"] = round(time.time() - t0, 3)
    return info
