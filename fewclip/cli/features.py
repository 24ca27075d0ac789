"""``fewclip features``: a feature file from any dataset and backbone (``fewclip.features.feature_file``).

    fewclip features backbone=toy-clip data=toy-colours out=colours.safetensors [views=20] [seed=1]

writes the frozen image tower's features of the dataset's training pool, validation pool and test set (all of
them, or ``data.max_test`` test images), the class text features of the dataset's templates
(``data.templates``), the backbone's geometry, and, with ``views=V``, V augmented views of the training images
drawn as the runs of seed ``seed`` draw theirs. So ``fewclip train data=features data.path=FILE seed=S`` trains
on what ``fewclip train data=DATASET seed=S`` trains on (``tests/test_feature_files.py`` checks the round
trip); a run of another seed uses the file's views as they are. Features come through the feature store
(``$FEWCLIP_CACHE``) like a run's, so a second file of the same dataset and backbone encodes nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from fewclip.backbones.backbone import load_backbone
from fewclip.config.compose import ConfigError, FeaturesConfig, load_config  # noqa: F401  (FeaturesConfig re-exported)
from fewclip.data.base import build_dataset
from fewclip.data.splits import test_items
from fewclip.features.encode import Augment, FeatureCache, View, class_text_features
from fewclip.features.feature_file import write_feature_file
from fewclip.features.store import open_store

log = logging.getLogger(__name__)


def write_features(cfg: FeaturesConfig, cache: Optional[FeatureCache] = None) -> Path:
    """Encode ``cfg.data`` with ``cfg.backbone`` and write the feature file ``cfg.out``."""
    if not cfg.out or not str(cfg.out).endswith(".safetensors"):
        raise ConfigError(f"out={cfg.out!r}: give the feature file to write, a path ending in .safetensors")
    dataset = build_dataset(cfg.data)
    backbone = load_backbone(cfg.backbone)
    cache = cache if cache is not None else FeatureCache()
    bs, workers = cfg.data.batch_size, cfg.data.workers

    def encode(items, view=None, desc="features"):
        return cache.features(backbone, dataset, items, view=view, batch_size=bs, workers=workers, desc=desc).features

    train_items = dataset.items("train")
    pairs = {"train": encode(train_items, desc="train"), "test": encode(test_items(dataset, cfg.data.max_test),
                                                                        desc="test")}
    val_items = dataset.splits.get("val", [])
    if val_items:
        pairs["val"] = encode(val_items, desc="val")
    views = None
    if cfg.views:
        augment = Augment.for_run(backbone, dataset)
        views = torch.stack([encode(train_items, View(augment, cfg.seed, k), f"train view {k + 1}/{cfg.views}").x
                             for k in range(cfg.views)])
    templates = dataset.prompts(cfg.data.templates)
    text = class_text_features(backbone, dataset.classnames, templates).cpu()
    source = {"backbone": backbone.describe(), "dataset": dataset.name, "data_root": cfg.data.root,
              "max_test": cfg.data.max_test, "views_seed": cfg.seed if cfg.views else None}
    return write_feature_file(cfg.out, train=pairs["train"], val=pairs.get("val"), test=pairs["test"],
                              classnames=dataset.classnames, templates=templates, text=text, views=views,
                              geometry={"name": backbone.geometry.name, "params": backbone.geometry.params()},
                              dataset=dataset.name, backbone=OmegaConf.to_container(OmegaConf.structured(cfg.backbone)),
                              source=source)


def cmd_features(args: Sequence[str], setup_logging) -> int:
    cfg = load_config(args, FeaturesConfig)
    setup_logging(cfg.log_level)
    path = write_features(cfg, FeatureCache(open_store()))  # the feature store ($FEWCLIP_CACHE), as train's
    print(f"features of {cfg.data.name} with {cfg.backbone.name} -> {path} ({path.stat().st_size / 2**20:.1f} MiB); "
          f"train on it: fewclip train adapter=tip_adapter_f data=features data.path={path}")
    return 0
