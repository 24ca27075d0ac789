"""The zero-shot baseline: geometry-aware class prototypes from prompt templates."""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import torch

from fewclip.datasets import Dataset, subsample_test

from .backbones import Backbone
from .features import accuracy, extract_features, text_prototypes

log = logging.getLogger(__name__)


def zeroshot_logits(backbone: Backbone, image_features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Logits [N, C] from raw image features and geometry-space prototypes."""
    return backbone.geometry.image_logits(image_features, prototypes)


def test_items(dataset: Dataset, max_test: Optional[int], seed: int):
    items = dataset.items("test")
    if max_test is not None and max_test < len(items):
        items = subsample_test(items, max_test, seed)
    return items


def evaluate_zeroshot(
    backbone: Backbone,
    dataset: Dataset,
    *,
    templates: str = "ensemble",
    batch_size: int = 256,
    workers: int = 0,
    max_test: Optional[int] = None,
    seed: int = 1,
    features: Optional[tuple] = None,
) -> Dict:
    """Zero-shot top-1 on the test split; ``features`` may pass precomputed (feats, labels)."""
    t0 = time.time()
    prompts = dataset.prompts(templates)
    protos = text_prototypes(backbone, dataset.classnames, prompts)
    if features is None:
        items = test_items(dataset, max_test, seed)
        features = extract_features(backbone, dataset, items, batch_size=batch_size, workers=workers,
                                    desc=f"{dataset.name} test")
    feats, labels = features
    logits = zeroshot_logits(backbone, feats, protos)
    metrics = accuracy(logits, labels, dataset.classnames)
    metrics.update({
        "method": "zeroshot",
        "dataset": dataset.name,
        "backbone": backbone.name,
        "shots": 0,
        "seed": seed,
        "templates": prompts,
        "geometry": backbone.geometry.name,
        "eval_time_s": round(time.time() - t0, 3),
    })
    log.info("zero-shot %s on %s: top1 %.2f%% (%d test images)", backbone.name, dataset.name,
             metrics["top1"], metrics["n_test"])
    return metrics
