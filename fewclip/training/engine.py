"""The training engine: one feature pipeline per run, a plain loop, and fit-style training.

Every image-tower pass of a run goes through ``RunFeatures``, which decides
once, from the adapter and the ``train`` section, where features come from:

* the frozen image tower (every adapter that does not train it): features are
  computed once per request (an ordered list of images as one view) and kept in
  a ``FeatureCache`` that the runs of a sweep share, backed by the on-disk
  feature store (``fewclip.features.store``) that worker processes and later sweeps
  share: test and validation images un-augmented, training images un-augmented
  and in augmented views;
* the adapter's own image tower (``adapter.trains_image_tower``, e.g. LoRA on
  the vision tower): every step encodes freshly augmented pixels through
  ``adapter.encode_images`` with gradients, and validation and test images are
  encoded through it as it is when asked.

A view is a pure function of (run seed, view index, image id)
(``fewclip.features.encode.View``). The loop trains epoch e on view e mod K of
``train.augment_views=K`` cached views, or on view e itself, encoded at every
step (``augment_views=0``, the faithful mode of CoOp's reference code: the same
pixels as K cached views for the first K epochs); ``train.augment=false``
trains on the un-augmented features.

How an adapter trains is its ``trained_by``: ``"loop"`` adapters get a
``FeatureSource`` that ``train_loop`` asks for batches and validation
features; ``"fit"`` adapters get a ``FitData`` (un-augmented features,
``adapter.fit_views()`` augmented views, validation features, the run's train
settings and generator) in ``adapter.fit``; ``None`` adapters train on
nothing.

Loop defaults follow the CoOp protocol: SGD, lr 0.002, momentum 0.9, weight
decay 5e-4, cosine schedule after one warm-up epoch at a constant 1e-5, batch
32, epochs 50/100/100/200/200 for 1/2/4/8/16 shots, RandomResizedCrop + flip.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

from fewclip.config.sections import AMP_MODES, OPTIMIZERS, TrainConfig  # noqa: F401  (re-exported: the train section)
from fewclip.features.encode import Augment, FeatureCache, Features, View, accuracy, extract_features, progress
from fewclip.training.compiled import StepTuner
from fewclip.training.cost import RunCost
from fewclip.utils.errors import NonFiniteError
from fewclip.utils.explog import current as experiment_log
from fewclip.utils.rng import forked_global_rng

log = logging.getLogger(__name__)

COOP_EPOCHS = {1: 50, 2: 100, 4: 100, 8: 200, 16: 200}
# sgd: momentum and weight decay; adam: L2 weight decay added to the gradient (torch.optim.Adam, as Dassl's
# "adam"); adamw: decoupled weight decay.
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


def cosine_lr(step: int, total: int, warmup: int, base: float, warmup_lr: float) -> float:
    """Constant ``warmup_lr`` for the warm-up steps, then cosine from ``base`` to 0 (CoOp's ConstantWarmup + cosine)."""
    if step < warmup:
        return warmup_lr
    t = (step - warmup) / max(1, total - warmup)
    return 0.5 * base * (1 + math.cos(math.pi * t))


def make_optimizer(params, cfg: TrainConfig, fused: bool = False) -> torch.optim.Optimizer:
    """The optimiser of the ``train`` section: SGD (lr, momentum, weight decay), Adam (lr, L2 weight decay, eps)
    or AdamW (lr, decoupled weight decay, eps); ``fused``: torch's fused kernel (``fewclip.training.compiled``)."""
    params = list(params)
    extra = {"fused": True} if fused else {}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **extra)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.eps, **extra)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.eps, **extra)


def amp_dtype(device: torch.device, amp: str) -> Optional[torch.dtype]:
    """The autocast dtype of ``train.amp`` on ``device``: "auto" is bf16 on CUDA and none elsewhere; "bf16" and
    "fp16" hold on every device (the CPU's autocast too, so the same path is tested without a GPU)."""
    if amp == "auto":
        amp = "bf16" if device.type == "cuda" else "none"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)


def amp_autocast(device: torch.device, amp: str):
    """Autocast for ``train.amp`` on ``device`` (``amp_dtype``); off for "none" (and "auto" off CUDA)."""
    dtype = amp_dtype(device, amp)
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(adapter, feats: torch.Tensor, labels: torch.Tensor, classnames, batch_size: int = 4096,
             amp: str = "none") -> dict:
    device = adapter.backbone.device
    outs = []
    with amp_autocast(device, amp):
        for i in range(0, len(feats), batch_size):
            outs.append(adapter(feats[i : i + batch_size].to(device)).float().cpu())
    logits = torch.cat(outs) if outs else torch.empty(0, len(classnames))
    bad = ~torch.isfinite(logits).all(dim=-1)
    if bool(bad.any()):  # argmax of NaN logits is a label like any other: a chance-level number, not an error
        raise NonFiniteError(f"{getattr(adapter, 'name', type(adapter).__name__)} gives NaN or infinite logits for "
                             f"{int(bad.sum())} of {len(logits)} images; the run is not recorded as finished (a "
                             f"diverged training: lower train.lr, or check the data)")
    return accuracy(logits, labels, classnames)


# ---------------------------------------------------------------------------
# what a run trains on
# ---------------------------------------------------------------------------


class FeatureSource:
    """What the loop trains on, chosen once per run: ``batch(epoch, idx)`` gives the adapter's inputs [B, D]
    for training images ``idx`` in epoch ``epoch``, ``validation()`` the validation features as the adapter
    sees them now ([0, D] when the split has none); ``labels`` [N] are the training labels."""

    labels: torch.Tensor

    def batch(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def validation(self) -> Features:
        raise NotImplementedError

    def frozen(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        """The frozen image tower's features [B, D] of the same pixels as ``batch(epoch, idx)`` (for adapters
        with ``wants_frozen_features``)."""
        raise NotImplementedError

    @property
    def epoch_size(self) -> int:
        """How many of ``labels`` one epoch draws (a shuffle of all of them, cut after this many, in batches):
        all of them by default; fewer for a source that pools several views of each image (CLAP's authors)."""
        return len(self.labels)


class CachedFeatures(FeatureSource):
    """Precomputed features: epoch e uses ``views[e % len(views)]`` (augmented views, or the un-augmented
    features as the only view). A fit-style adapter can hand its ``FitData`` to ``train_loop`` this way."""

    def __init__(self, views: Sequence[Features], val: Features):
        if not views:
            raise ValueError("CachedFeatures needs at least one view of the training images")
        self.views = list(views)
        self.labels = self.views[0].y
        self.val = val

    def batch(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        return self.views[epoch % len(self.views)].x[idx]

    def frozen(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        return self.batch(epoch, idx)  # cached features are the frozen tower's

    def validation(self) -> Features:
        return self.val


class FreshImages(FeatureSource):
    """View ``epoch`` of each image in the batch (the un-augmented image with ``train.augment=false``), encoded
    at every step: by the frozen tower (the faithful mode, in the backbone's precision, no gradients) or by the
    adapter's own image tower (with gradients, under the step's autocast)."""

    def __init__(self, run: RunFeatures):
        self.run = run
        self.labels = torch.tensor([it.label for it in run.split.train], dtype=torch.long)
        self.plain = None if run.cfg.augment else run.backbone.preprocess()
        self._frozen: tuple[int, Optional[torch.Tensor]] = (-1, None)

    def batch(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        run = self.run
        view = run.view(epoch)
        items = [run.split.train[int(i)] for i in idx]
        images = [run.dataset.load_image(it) for it in items]
        pixels = torch.stack([view(im, it) if self.plain is None else self.plain(im) for im, it in zip(images, items)])
        run.cost.count_images(len(items))
        if run.own_tower:
            return run.adapter.encode_images(pixels)
        with torch.no_grad(), torch.autocast(run.backbone.device.type, enabled=False):
            return run.backbone.encode_images(pixels)

    def frozen(self, epoch: int, idx: torch.Tensor) -> torch.Tensor:
        """From the run's feature cache: view ``epoch`` of every training image, encoded once by the frozen
        tower (and shared with the runs of a sweep that ask for the same view)."""
        if self._frozen[0] != epoch:
            view = self.run.view(epoch) if self.plain is None else None
            self._frozen = (epoch, self.run.frozen_train(view).x)
        return self._frozen[1][idx]

    def validation(self) -> Features:
        return self.run.validation()


@dataclass
class FitData:
    """What a fit-style adapter's ``fit`` gets: raw image-tower features of the few-shot split, and the run's
    training settings."""

    train: Features  # the un-augmented training images [N, D], labels [N]
    views: list[Features]  # adapter.fit_views() augmented views of the same images, in the same order
    val: Features  # the validation images ([0, D] when the split has none)
    cfg: TrainConfig  # the run's train section (the adapter's train_defaults, then the user's overrides)
    shots: int
    generator: torch.Generator  # for any random draw (the run's generator)


class RunFeatures:
    """Every image-tower pass of one run (module docstring). The adapter's ``trains_image_tower`` is asked here,
    once: with it, images go through ``adapter.encode_images`` whenever asked; without it, through the
    frozen tower once per request, shared through ``cache`` (and its feature store). Every image is counted in
    ``cost``."""

    def __init__(self, adapter, dataset, split, cfg: TrainConfig, *, seed: int, cache: Optional[FeatureCache] = None,
                 cost: Optional[RunCost] = None, batch_size: int = 256, workers: int = 0):
        self.adapter = adapter
        self.backbone = adapter.feature_tower()  # the frozen tower whose features the adapter takes
        self.dataset = dataset
        self.split = split  # None for an adapter that trains on nothing
        self.cfg = cfg
        self.seed = seed
        self.cache = cache if cache is not None else FeatureCache()
        self.cost = cost if cost is not None else RunCost(self.backbone.device)
        self.batch_size, self.workers = batch_size, workers
        self.own_tower = bool(adapter.trains_image_tower)
        self.augment = Augment.for_run(self.backbone, dataset, cfg.crop_scale_min)
        self._val: Optional[Features] = None

    def view(self, index: int) -> View:
        """Augmented view ``index`` of this run's training images."""
        return View(self.augment, self.seed, index)

    def _encode(self, items: Sequence, view: Optional[View], desc: str) -> Features:
        if self.own_tower:
            adapter, was_training = self.adapter, self.adapter.training
            adapter.eval()
            with torch.no_grad(), amp_autocast(self.backbone.device, self.cfg.amp):
                out = extract_features(self.backbone, self.dataset, items, view=view, batch_size=self.batch_size,
                                       workers=self.workers, desc=desc, encode=adapter.encode_images)
            adapter.train(was_training)
            self.cost.count_images(len(items))
            return out
        got = self.cache.features(self.backbone, self.dataset, items, view=view, batch_size=self.batch_size,
                                  workers=self.workers, desc=desc)
        self.cost.count_images(len(items), got.encoded, got.from_store)
        return got.features

    def train_plain(self) -> Features:
        """The un-augmented training images."""
        return self._encode(self.split.train, None, "train")

    def frozen_train(self, view: Optional[View]) -> Features:
        """The training images through the frozen tower (``view`` None: un-augmented), from the cache, whatever
        tower the adapter trains."""
        got = self.cache.features(self.backbone, self.dataset, self.split.train, view=view,
                                  batch_size=self.batch_size, workers=self.workers, desc="train (frozen tower)")
        self.cost.count_images(len(self.split.train), got.encoded, got.from_store)
        return got.features

    def train_views(self, k: int) -> list[Features]:
        """Views 0 .. k-1 of the training images."""
        return [self._encode(self.split.train, self.view(i), f"train view {i + 1}/{k}") for i in range(k)]

    def validation(self) -> Features:
        """The validation images as the adapter sees them now: computed once for the frozen tower, through the
        adapter's own tower at every call."""
        if self._val is not None:
            return self._val
        items = self.split.val if self.split is not None else []
        if not items:
            val = Features.empty(self.dim())
        else:
            val = self._encode(items, None, "val")
        if not self.own_tower:
            self._val = val
        return val

    def test(self, items: Sequence) -> Features:
        return self._encode(items, None, f"{self.dataset.name} test")

    def dim(self) -> int:
        """Width of the image tower's output (a feature backbone, which has no text tower, says it)."""
        return int(getattr(self.backbone, "feature_dim", None) or self.backbone.encode_text(["a"]).shape[-1])

    # -- what each kind of adapter trains on ----------------------------------
    def loop_source(self, epochs: int) -> FeatureSource:
        """The loop's feature source for a run of ``epochs`` epochs."""
        cfg = self.cfg
        if self.own_tower or (cfg.augment and cfg.augment_views == 0):
            return FreshImages(self)
        views = [self.train_plain()] if not cfg.augment else self.train_views(min(cfg.augment_views, epochs))
        # validation images are encoded only for a loop that selects on them
        val = self.validation() if cfg.select == "val" else Features.empty(views[0].x.shape[1])
        return CachedFeatures(views, val)

    def fit_data(self, views: int, shots: int, generator: torch.Generator) -> FitData:
        if self.own_tower:
            raise ValueError(f"adapter {self.adapter.name!r} trains its image tower, so it is trained by the loop "
                             f"(trained_by = 'loop'), not by fit()")
        return FitData(self.train_plain(), self.train_views(views), self.validation(), self.cfg, shots, generator)


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def schedule(cfg: TrainConfig, shots: int, n: int) -> tuple[int, int, int, int]:
    """(steps per epoch, total steps, epochs, warm-up steps) of the loop on ``n`` training images."""
    per_epoch = math.ceil(n / cfg.batch_size)
    total = total_steps(cfg, shots, per_epoch)
    epochs = math.ceil(total / per_epoch)
    return per_epoch, total, epochs, min(cfg.warmup_epochs * per_epoch, total)


def train_loop(adapter, source: FeatureSource, cfg: TrainConfig, shots: int, generator: torch.Generator) -> dict:
    """The gradient loop: the adapter's ``training_loss`` (cross-entropy by default) on ``source``'s batches,
    its ``backward``, ``make_optimizer``, CoOp's cosine schedule, ``on_epoch_end`` after each epoch;
    ``train.select=val`` keeps the epoch with the best validation accuracy. Batch order comes from ``generator``;
    code that draws from torch's global RNG (dropout) runs on a fork of it seeded from ``generator``."""
    device = adapter.backbone.device
    params = adapter.trainable_parameters()
    if not params:
        raise ValueError(f"adapter {adapter.name!r} has no trainable parameters")

    n = len(source.labels)
    per_epoch, total, epochs, warmup = schedule(cfg, shots, source.epoch_size)
    # An adapter may give parameter groups whose learning rate is the run's times "lr_scale" (DePT's head).
    groups = adapter.param_groups()

    def make(ps, fused=False):  # the tuner's optimiser of all the parameters: in the adapter's groups, if any
        return make_optimizer(groups if groups is not None and ps is params else ps, cfg, fused)

    tuner = StepTuner(adapter, params, cfg.compile, make, total, str(amp_dtype(device, cfg.amp)))
    opt = tuner.optimizer
    best = (-1.0, None, -1)
    history = []
    wants_frozen = adapter.wants_frozen_features
    own_lr = adapter.learning_rate  # Adapter.learning_rate: None from it is the engine's schedule (2SFS: its own)
    xlog = experiment_log()  # the run's experiment log (log=tensorboard|wandb), if any
    step = 0
    adapter.train()
    with forked_global_rng(generator), tuner:  # the tuner puts the eager text step back on the way out
        # By step, so that a long epoch (thousands of images) still reports; the epoch and its loss as postfix.
        bar = progress(total=total, desc=f"train {adapter.name}", unit="step", leave=False)
        for epoch in range(epochs):
            perm = torch.randperm(n, generator=generator)
            sums, seen = {}, 0
            for b in range(min(per_epoch, total - step)):
                idx = perm[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                own = own_lr(step, total, cfg.lr)  # the method's own schedule, or None
                for g in opt.param_groups:
                    scale = g.get("lr_scale", 1.0)  # a group at its own multiple of the run's lr (DePT)
                    g["lr"] = own * scale if own is not None else cosine_lr(step, total, warmup, cfg.lr * scale,
                                                                            cfg.warmup_lr)
                tuner.start()
                y = source.labels[idx].to(device)
                extra = {"frozen": source.frozen(epoch, idx).to(device)} if wants_frozen else {}
                with amp_autocast(device, cfg.amp):
                    terms = adapter.training_loss(source.batch(epoch, idx).to(device), y, **extra)
                # every term read back in one host sync per step (one on a GPU, not one per term)
                read = torch.stack([v.detach().float().reshape(()) for v in terms.values()]).tolist()
                values = dict(zip(terms, read))
                if not math.isfinite(values["loss"]):  # stop: nothing non-finite is trained on, saved or recorded
                    raise NonFiniteError(f"the training loss became {values['loss']} at step {step + 1} "
                                         f"(epoch {epoch + 1}) of {adapter.name}; the run is stopped and not "
                                         f"recorded. Lower train.lr (now {cfg.lr}) or check the data")
                opt.zero_grad(set_to_none=True)
                adapter.backward(terms)
                opt.step()
                xlog.step(step + 1, values, opt.param_groups[0]["lr"])
                opt = tuner.stop(opt)
                for k, v in values.items():
                    sums[k] = sums.get(k, 0.0) + v * len(idx)
                seen += len(idx)
                step += 1
                bar.update(1)
            adapter.on_epoch_end(epoch, epochs)
            entry = {"epoch": epoch + 1, **{k: v / max(seen, 1) for k, v in sums.items()}}
            if cfg.select == "val":
                vx, vy = source.validation()
                if len(vy):
                    acc = evaluate(adapter, vx, vy, adapter.classnames)["top1"]
                    entry["val_top1"] = acc
                    if acc > best[0]:
                        best = (acc, copy.deepcopy(adapter.adapter_state_dict()), epoch + 1)
            history.append(entry)
            xlog.epoch(step, entry)
            bar.set_postfix(epoch=f"{epoch + 1}/{epochs}", loss=f"{entry['loss']:.3f}",
                            **({"val_top1": f"{entry['val_top1']:.1f}"} if "val_top1" in entry else {}))
    bar.close()
    adapter.eval()
    # The last step's update comes after the last loss: a step that diverged there shows only in the parameters.
    bad = [i for i, p in enumerate(params) if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        raise NonFiniteError(f"{adapter.name}'s parameters became NaN or infinite at step {step} (the last); the run "
                             f"is stopped and not recorded. Lower train.lr (now {cfg.lr}) or check the data")
    info = {"epochs": epochs, "steps": step, "final_loss": history[-1]["loss"] if history else None,
            "loss_curve": [round(h["loss"], 5) for h in history]}
    if tuner.record() is not None:
        info["compile"] = tuner.record()
    # The adapter's other loss terms (KgCoOp's penalty, ProGrad's distillation loss), per epoch.
    terms = [k for k in (history[0] if history else {}) if k not in ("epoch", "loss", "val_top1")]
    if terms:
        info["loss_terms"] = {k: [round(h[k], 5) for h in history if k in h] for k in terms}
    if cfg.select == "val" and best[1] is not None:
        adapter.load_adapter_state_dict(best[1])
        info.update({"selected_epoch": best[2], "selected_val_top1": best[0]})
    return info


def fit_adapter(adapter, run: RunFeatures, cfg: TrainConfig, *, shots: int, generator: torch.Generator) -> dict:
    """Train ``adapter`` the way its ``trained_by`` says, on what ``run`` encodes; returns training info.
    The training itself (not the frozen tower's features it starts from) is timed into ``run.cost``."""
    if adapter.trained_by is None:
        return {}
    if adapter.trained_by == "fit":
        data = run.fit_data(adapter.fit_views(), shots, generator)
        with _timed(run.cost):
            return adapter.fit(data) or {}
    source = run.loop_source(schedule(cfg, shots, len(run.split.train))[2])
    with _timed(run.cost):
        return train_loop(adapter, source, cfg, shots, generator)


@contextmanager
def _timed(cost: RunCost):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        cost.train_time_s += time.perf_counter() - t0
