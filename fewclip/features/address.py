"""Where a group of stored features lives: its address, every setting the features are a function of.

Kept apart from the store itself (``fewclip.features.store``: files, locks, checks) so that code which only needs
an address, such as the encoder, loads none of the store's machinery.
"""
from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torchvision

from fewclip.utils.checksums import weights_checksum

FORMAT = "fewclip.features"
# 2: entries carry their images' fingerprint and a checksum; 3: a tower with a linear projection keeps its features
# before it (``Backbone.stored_variant``), the projected ones derived (v2 entries are not read: encoded again)
VERSION = 3
# Bump when the augmentation's draws or the evaluation pixels change for the same settings.
VIEW_CODE_VERSION = 1


def describe_transform(transform) -> str:
    """A transform's repr without memory addresses (open_clip's pipeline holds a plain function)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def address(backbone, dataset, view, batch_size: int) -> dict[str, Any]:
    """The group address of the features of ``dataset``'s images through ``backbone``'s frozen image tower,
    as ``view`` (None: the backbone's evaluation transform), encoded in batches of ``batch_size``."""
    if view is None:
        transform = {"kind": "eval", "transform": describe_transform(backbone.preprocess()),
                     "preprocess": backbone.preprocess_cfg.to_dict()}  # fill colour, mean, std: not all in the repr
    else:
        transform = {"kind": "view", "augment": asdict(view.augment), "seed": int(view.seed),
                     "index": int(view.index), "code": VIEW_CODE_VERSION}
    root = getattr(dataset, "root", None)
    return {
        "format": FORMAT,
        "version": VERSION,
        "backbone": backbone.name,
        "weights": weights_checksum(backbone),
        "variant": backbone.variant,
        "precision": str(backbone.dtype).replace("torch.", ""),
        "device": backbone.device.type,
        "dataset": dataset.name,
        "data_root": str(Path(root).resolve()) if root else None,
        "transform": transform,
        "batch_size": int(batch_size),
        "torchvision": ".".join(torchvision.__version__.split("+")[0].split(".")[:2]),
    }
