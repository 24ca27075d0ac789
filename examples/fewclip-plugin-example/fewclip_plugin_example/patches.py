"""colour-patches: a procedural dataset (no files): a coloured square on a grey background with noise.

Every image is drawn from (split, index), so the dataset is the same on every machine. The colour names are
words the reference backbones' word-level tokenizer knows.
"""
from __future__ import annotations

import zlib

import numpy as np
from PIL import Image

from fewclip.data.base import DataConfig, Dataset, Item, register_dataset

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 220, 40),
           "purple": (140, 50, 180)}
SIZES = {"train": 20, "val": 8, "test": 30}  # images per class
TEMPLATES = ["a photo of a {} square.", "a {} shape."]


class ColourPatches(Dataset):
    hflip_ok = True

    def load_image(self, item: Item) -> Image.Image:
        rng = np.random.default_rng(zlib.crc32(item.id.encode()))
        img = np.full((32, 32, 3), 128, dtype=np.float64) + rng.normal(0, 30, (32, 32, 3))
        size = int(rng.integers(10, 20))
        x, y = (int(v) for v in rng.integers(0, 32 - size, 2))
        img[y:y + size, x:x + size] = np.array(list(COLOURS.values())[item.label]) + rng.normal(0, 20, 3)
        return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def build(cfg: DataConfig) -> ColourPatches:
    names = list(COLOURS)
    splits = {split: [Item(f"{split}/{c}/{i}", c) for c in range(len(names)) for i in range(n)]
              for split, n in SIZES.items()}
    return ColourPatches(name=cfg.name, classnames=names, templates=TEMPLATES, splits=splits)


register_dataset("colour-patches", build, description="coloured squares on noise (fewclip-plugin-example)",
                 layout="no files: procedural", needs_root=False)
