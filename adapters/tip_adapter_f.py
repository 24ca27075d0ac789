"""Tip-Adapter-F: Tip-Adapter with its cache keys fine-tuned by AdamW, then beta and alpha searched again.

Zhang et al., ECCV 2022; defaults from the authors' code (github.com/gaopengcuhk/Tip-Adapter @ d0e2d6f,
``main.py:run_tip_adapter_F``, ``configs/imagenet.yaml``): the cache of ``fewclip.adapters.tip_adapter``
(keys from 10 augmented views, one-hot values), whose keys [N, D] become a parameter trained with the
cross-entropy of Tip-Adapter's logits at ``init_beta`` and ``init_alpha``: AdamW lr 1e-3, eps 1e-4, weight
decay 0.01 (AdamW's default, which the authors' code leaves in place), cosine schedule over every step
without warm-up, batch 256, 20 epochs (100 for EuroSAT in the authors' configs). These are the adapter's
``train`` defaults (``fewclip train adapter=tip_adapter_f --help``); ``fit`` runs the engine's loop with them.

The keys are trained as the geometry's point coordinates and are not re-normalised (as in the authors'
code, where a key leaves the unit sphere as it trains and the affinity uses ``f . k``); the hyperboloid's
space components and R^D are global coordinates of their geometries, so any key is a point there.

Where fewclip differs, and why:

* Training data: the authors encode freshly augmented support images every epoch; fewclip trains epoch e on
  cached view ``views + (e mod train_views)`` of the run's shared views (views 10-19 by default: distinct
  from the cache's views 0-9, and the same 20 views CLAP asks for), so it encodes no image beyond them.
* Selection: the authors keep the epoch with the best **test** accuracy, search beta and alpha on
  validation with it, and report the better of two test accuracies (``main.py:114-141``); fewclip keeps the
  epoch with the best few-shot **validation** accuracy (``train.select=val``; the first best on ties) and
  searches on validation only (``tip_adapter``'s rules). Test images are never seen before testing.

At initialisation the logits are Tip-Adapter's, and with alpha = 0 the zero-shot logits.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor, nn

from fewclip.adapter.base import register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters.tip_adapter import TipAdapter, TipAdapterConfig
from fewclip.config.presets import Preset, Setting, register_presets
from fewclip.training.engine import CachedFeatures, train_loop

log = logging.getLogger(__name__)


@dataclass
class TipAdapterFConfig(TipAdapterConfig):
    name: str = field(default="tip_adapter_f", metadata={"help": "The method (`fewclip adapters` lists them)."})
    train_views: int = field(default=10, metadata={"help": (
        'Cached views the keys are trained on, after the `views` of the cache: epoch e uses view views + e mod '
        'this.')})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train_views < 1:
            raise ValueError(f"adapter.train_views must be >= 1, got {self.train_views}")


class TipAdapterF(TipAdapter):
    """Tip-Adapter whose cache keys are a parameter, fine-tuned by the engine's loop."""

    name = "tip_adapter_f"
    train_defaults = {"optimizer": "adamw", "lr": 1e-3, "eps": 1e-4, "weight_decay": 0.01, "batch_size": 256,
                      "epochs": 20, "warmup_epochs": 0, "select": "val"}

    def _set_keys(self, keys: Tensor) -> None:
        if "cache_keys" in self._buffers:
            del self._buffers["cache_keys"]
        self.cache_keys = nn.Parameter(keys.detach().clone())

    def fit_views(self) -> int:
        return self.cfg.views + self.cfg.train_views

    def fit(self, data) -> dict:
        """The cache, the keys fine-tuned (epoch selected on validation), then beta and alpha searched."""
        cfg: TipAdapterFConfig = self.cfg
        self.build_cache([v.x for v in data.views[: cfg.views]], data.train.y)
        train_views = data.views[cfg.views : cfg.views + cfg.train_views]
        info = train_loop(self, CachedFeatures(train_views, data.val), data.cfg, data.shots, data.generator)
        found = self.search(data.val)
        return {**info, **found}


register_adapter("tip_adapter_f", TipAdapterFConfig, TipAdapterF, export=STATE)

register_presets(
    "tip_adapter_f",
    Preset("authors", "Tip-Adapter-F's released code (main.py:run_tip_adapter_F, configs/imagenet.yaml)", settings=(
        Setting("adapter.tie_break", "first", "gaopengcuhk/Tip-Adapter@d0e2d6f utils.py:121",
                "their search keeps the first best grid point (strict >); fewclip the lowest validation loss"),),
        not_expressed=("freshly augmented support images every epoch (gaopengcuhk/Tip-Adapter@d0e2d6f main.py:85-88); "
                       "fewclip trains on its cached views 10-19",
                       "100 epochs for EuroSAT (gaopengcuhk/Tip-Adapter@d0e2d6f configs/eurosat.yaml:31): add "
                       "train.epochs=100 there")),
    on_test=("Tip-Adapter-F's authors keep the epoch with the best test accuracy and report the better of two test "
             "accuracies, gaopengcuhk/Tip-Adapter@d0e2d6f main.py:114-141"))
