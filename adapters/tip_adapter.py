"""Tip-Adapter: a training-free key-value cache of few-shot image features added to the zero-shot logits.

Zhang et al., "Tip-Adapter: Training-free Adaption of CLIP for Few-shot Classification", ECCV 2022; defaults
from the authors' code (github.com/gaopengcuhk/Tip-Adapter @ d0e2d6f, ``main.py``, ``utils.py``,
``configs/imagenet.yaml``)::

    logits(x) = zero-shot logits(x) + alpha * exp(beta (s(x, k) - s_max)) @ L

with keys ``k`` the few-shot training images, ``L`` their one-hot labels [N, C], ``s`` the backbone
geometry's similarity and ``s_max`` its value for a point and itself. In the clip geometry this is the
authors' ``exp(-beta (1 - cos))``; elsewhere (``fewclip.adapters._cache.affinity``) ``exp(-beta angle)``
(elliptic), ``exp(-beta d)`` with d the Euclidean or Lorentz distance (a Laplacian kernel), ``exp(-beta d^2)``
for the squared distances (a Gaussian kernel), the cosine for sigmoid (whose bias is not part of the
similarity). The zero-shot logits are the geometry's own (its logit scale, not the authors' constant 100,
which is OpenAI CLIP's scale). With alpha = 0 the logits are the zero-shot logits, in every geometry.

Cache keys (``utils.build_cache_model``): ``views`` (10) augmented views of each training image; their raw
tower outputs are averaged, then embedded (the authors average raw features, then normalise): in the
Euclidean and hyperbolic geometries that is the mean in the geometry's linear (tangent) space, where it
averages prompt templates too. The views are the run's shared augmented views (``fewclip.training.engine.RunFeatures``:
CoOp's crop of the dataset, not the authors' RandomResizedCrop scale (0.5, 1)), so a sweep encodes each view
of an image once for every method.

Search (``utils.search_hp``): beta over ``authors_grid(beta_max, beta_steps)`` and alpha over
``authors_grid(alpha_max, alpha_steps)`` (ImageNet's config: 200 values in [0.1, 7), 20 in [0.1, 3)), best
validation accuracy. fewclip searches the **few-shot validation split only** (``min(shots, 4)`` images per
class); the authors search the dataset's full validation split, and for ImageNet the test set
(``main_imagenet.py``), which fewclip never does. On fewclip's small validation splits many grid points tie
(1102 of 4000 on the parity fixture): ``tie_break="loss"`` (the default) keeps the tied point with the
lowest validation cross-entropy, ``"first"`` the authors' first maximum in beta-major order. Without
validation images (or ``search=false``) beta and alpha stay at ``init_beta`` and ``init_alpha``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import TIE_BREAKS, affinity, authors_grid, search_alpha_beta, self_similarity, text_classifier
from fewclip.config.presets import Preset, Setting, register_presets

log = logging.getLogger(__name__)


@dataclass
class TipAdapterConfig(AdapterConfig):
    name: str = field(default="tip_adapter", metadata={"help": "The method (`fewclip adapters` lists them)."})
    views: int = field(default=10, metadata={"help": (
        "Augmented views of each training image averaged into its cache key (the authors' augment_epoch).")})
    init_beta: float = field(default=1.0, metadata={"help": (
        "beta and alpha without a search (the authors' init_beta, and ImageNet's init_alpha).")})
    init_alpha: float = field(default=1.17, metadata={"help": (
        "alpha (the cache's weight in the logits) without a search.")})
    search: bool = field(default=True, metadata={"help": 'Search beta and alpha on the few-shot validation split.'})
    beta_max: float = field(default=7.0, metadata={"help": (
        "The grids: `steps` values from 0.1 up to, not including, `max` (ImageNet's search_scale and "
        'search_step).')})
    beta_steps: int = field(default=200, metadata={"help": (
        "Points of the beta grid searched on validation, over (0, beta_max].")})
    alpha_max: float = field(default=3.0, metadata={"help": "Largest alpha searched on validation."})
    alpha_steps: int = field(default=20, metadata={"help": (
        "Points of the alpha grid searched on validation, over (0, alpha_max].")})
    tie_break: str = field(default="loss", metadata={"help": (
        'Among grid points of equal validation accuracy: "loss" (lowest cross-entropy) or "first" (the authors\').')})

    def __post_init__(self) -> None:
        if self.views < 1:
            raise ValueError(f"adapter.views must be >= 1, got {self.views}")
        for key in ("init_beta", "init_alpha"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"adapter.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("beta_max", "alpha_max"):
            if not getattr(self, key) > 0.1:
                raise ValueError(f"adapter.{key} must be > 0.1 (the grid starts at 0.1), got {getattr(self, key)}")
        for key in ("beta_steps", "alpha_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"adapter.{key} must be >= 1, got {getattr(self, key)}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"adapter.tie_break must be one of {', '.join(TIE_BREAKS)}, got {self.tie_break!r}")


class TipAdapter(Adapter):
    """Zero-shot logits plus ``alpha`` times the cache's affinity-weighted labels."""

    name = "tip_adapter"
    trained_by = "fit"

    def __init__(self, cfg: TipAdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes  # [C, D]
        C, D = protos.shape
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        # on the geometry's device, moved with the adapter (a plain float read it back from the device)
        self.register_buffer("s_max", self_similarity(backbone.geometry, D), persistent=False)
        # What fit() finds is saved: the cache (empty until fit: the zero-shot classifier) and beta, alpha.
        self.register_buffer("beta", torch.tensor(float(cfg.init_beta)))
        self.register_buffer("alpha", torch.tensor(float(cfg.init_alpha)))
        self.register_buffer("cache_values", torch.zeros(0, C))
        self._set_keys(torch.zeros(0, D))

    # -- the cache ----------------------------------------------------------
    def _set_keys(self, keys: Tensor) -> None:
        """Cache keys [N, D], points of the geometry (a buffer here; Tip-Adapter-F makes them a parameter)."""
        self.register_buffer("cache_keys", keys)

    def load_adapter_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Load a saved state whatever its cache size (the state of an unfitted adapter has an empty cache)."""
        if "cache_keys" in sd and "cache_values" in sd:
            self.cache_values = torch.empty_like(sd["cache_values"], device=self.cache_values.device)
            self._set_keys(torch.empty_like(sd["cache_keys"], device=self.cache_keys.device))
        super().load_adapter_state_dict(sd)

    @torch.no_grad()
    def build_cache(self, views: Sequence[Tensor], labels: Tensor) -> None:
        """Keys from ``views`` ([N, D] raw features of the same N images each): mean of the raw views, then
        embedded; values: one-hot labels [N, C]."""
        g = self.backbone.geometry
        raw = torch.stack(list(views)).mean(0).to(self.prototypes.device)  # [N, D]
        self._set_keys(g.embed_image(raw))
        self.cache_values = F.one_hot(labels.to(raw.device), len(self.classnames)).to(raw.dtype)

    # -- logits -------------------------------------------------------------
    def cache_logits(self, img: Tensor) -> Tensor:
        """Affinity-weighted labels of embedded images [B, D] -> [B, C] (without alpha)."""
        A = affinity(self.backbone.geometry, img, self.cache_keys, self.beta, self.s_max)  # [B, N]
        return A @ self.cache_values

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        g = self.backbone.geometry
        img = g.embed_image(features.to(self.prototypes.device))
        zs = g.logits(img, self.prototypes)  # [B, C]
        if self.cache_keys.shape[0] == 0:  # not fitted: the zero-shot classifier
            return zs
        return zs + self.alpha * self.cache_logits(img)

    # -- training -----------------------------------------------------------
    def fit_views(self) -> int:
        return self.cfg.views

    def fit(self, data) -> dict:
        """Build the cache from the first ``views`` views, then search beta and alpha on validation."""
        views = data.views[: self.cfg.views]
        self.build_cache([v.x for v in views], data.train.y)
        return self.search(data.val)

    @torch.no_grad()
    def search(self, val) -> dict:
        """Set beta and alpha to the best grid point on the validation features ``val`` (raw, with labels)."""
        cfg: TipAdapterConfig = self.cfg
        vx, vy = val
        if not cfg.search or vy.numel() == 0:
            if cfg.search:
                log.warning("%s: no validation images; keeping beta=%g, alpha=%g", self.name, cfg.init_beta,
                            cfg.init_alpha)
            return {"beta": float(self.beta), "alpha": float(self.alpha), "searched": False}
        g = self.backbone.geometry
        img = g.embed_image(vx.to(self.prototypes.device))
        zs = g.logits(img, self.prototypes)
        dist = self.s_max - g.similarity(img, self.cache_keys)  # [B, N]
        betas, alphas = authors_grid(cfg.beta_max, cfg.beta_steps), authors_grid(cfg.alpha_max, cfg.alpha_steps)
        beta, alpha, acc = search_alpha_beta(zs, dist, self.cache_values, vy.to(zs.device), betas, alphas,
                                             cfg.tie_break)
        self.beta.fill_(beta)
        self.alpha.fill_(alpha)
        zs_acc = 100.0 * float((zs.argmax(-1).cpu() == vy).double().mean())
        log.info("%s: beta=%.4g alpha=%.4g (val top1 %.2f%%, zero-shot %.2f%%)", self.name, beta, alpha,
                 float(acc.max()), zs_acc)
        return {"beta": beta, "alpha": alpha, "searched": True, "val_acc": float(acc.max()),
                "zeroshot_val_acc": zs_acc, "val_ties": int((acc == acc.max()).sum())}


register_adapter("tip_adapter", TipAdapterConfig, TipAdapter, export=STATE)

TIP = "gaopengcuhk/Tip-Adapter@d0e2d6f"
register_presets(
    "tip_adapter",
    Preset("authors", "Tip-Adapter's released code (main.py, utils.py, configs/imagenet.yaml)", settings=(
        Setting("adapter.tie_break", "first", f"{TIP} utils.py:121",
                "their search keeps the first best grid point (strict >); fewclip the lowest validation loss"),),
        not_expressed=(f"per-dataset grids and init_alpha ({TIP} configs/<dataset>.yaml:17-21, e.g. caltech101 "
                       f"search_scale [12, 5], init_alpha 3): set adapter.beta_max, alpha_max, init_alpha",
                       f"the search on the dataset's whole validation split ({TIP} main.py:47); fewclip searches "
                       f"its few-shot validation split")),
    on_test=f"Tip-Adapter's authors search beta and alpha on ImageNet's test set, {TIP} main_imagenet.py:43")
