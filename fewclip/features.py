"""Image features and class prototypes from a frozen backbone."""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset as TorchDataset
from tqdm.auto import tqdm

from .backbones import Backbone

log = logging.getLogger(__name__)


class ImageItems(TorchDataset):
    """Items of a fewclip dataset as (pixels, label) pairs through a transform."""

    def __init__(self, dataset, items: Sequence, transform: Callable):
        self.dataset = dataset
        self.items = list(items)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        item = self.items[i]
        return self.transform(self.dataset.load_image(item)), item.label


def progress(iterable=None, **kwargs):
    """A tqdm bar on an interactive terminal at log level info or lower; silent otherwise."""
    import sys

    quiet = logging.getLogger("fewclip").getEffectiveLevel() > logging.INFO or not sys.stderr.isatty()
    return tqdm(iterable, disable=quiet, **kwargs)


@torch.no_grad()
def extract_features(
    backbone: Backbone,
    dataset,
    items: Sequence,
    *,
    transform: Optional[Callable] = None,
    batch_size: int = 256,
    workers: int = 0,
    desc: str = "features",
    encode: Optional[Callable] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Raw image-tower outputs [N, D] (float32, on CPU) and labels [N] for ``items``;
    ``encode`` replaces ``backbone.encode_images`` (an adapter's adapted image tower)."""
    encode = encode or backbone.encode_images
    transform = transform or backbone.preprocess()
    loader = DataLoader(ImageItems(dataset, items, transform), batch_size=batch_size, shuffle=False,
                        num_workers=workers)
    feats: List[torch.Tensor] = []
    labels: List[torch.Tensor] = []
    for pixels, y in progress(loader, desc=desc, unit="batch", leave=False):
        feats.append(encode(pixels).float().cpu())
        labels.append(y)
    if not feats:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def text_prototypes(backbone: Backbone, classnames: Sequence[str], templates: Sequence[str]) -> torch.Tensor:
    """Geometry-space class prototypes [C, D]: every template per class, averaged by the geometry."""
    if not templates:
        raise ValueError("at least one prompt template is needed")
    bad = [t for t in templates if t.count("{}") != 1]
    if bad:
        raise ValueError(f"each prompt template needs exactly one '{{}}' for the class name; bad: {bad}")
    texts = [t.format(c) for c in classnames for t in templates]
    raw = backbone.encode_text(texts)  # C*T, D
    emb = backbone.geometry.embed_text(raw)
    C, T = len(classnames), len(templates)
    return backbone.geometry.prototype(emb.reshape(C, T, -1))


def accuracy(logits: torch.Tensor, labels: torch.Tensor, classnames: Sequence[str]) -> dict:
    """Top-1 in percent, per-class accuracy in percent, and the number of test images."""
    pred = logits.argmax(dim=-1).cpu()
    labels = labels.cpu()
    correct = (pred == labels).float()
    per_class = {}
    for c, name in enumerate(classnames):
        m = labels == c
        per_class[name] = round(100.0 * float(correct[m].mean()), 4) if m.any() else None
    return {"top1": round(100.0 * float(correct.mean()), 4), "per_class": per_class, "n_test": int(labels.numel())}
