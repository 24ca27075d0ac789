"""npz: an open_clip model's state dict saved with ``numpy.savez`` (as JAX and numpy pipelines export it).

``fewclip import npz model.npz model=ARCH out=DIR`` reads the arrays (never unpickling: ``allow_pickle=False``)
and makes the same card as fewclip's own open_clip format would from the same tensors.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fewclip.backbones.formats.open_clip import open_clip_card
from fewclip.backbones.importer import CheckpointImportError, Format, Imported, register_format


def read_npz(path: Path, options: dict[str, str]) -> Imported:
    try:
        with np.load(path, allow_pickle=False) as arrays:
            sd = {k: torch.from_numpy(np.array(arrays[k])) for k in arrays.files}
    except (OSError, ValueError) as e:
        raise CheckpointImportError(f"{path} is not a readable .npz of arrays ({e})") from None
    return open_clip_card(sd, path, options, fmt="npz")


register_format(Format(
    name="npz",
    read=read_npz,
    options={"model": "the open_clip architecture of the arrays (e.g. ViT-B-32)"},
    required=("model",),
    summary="an open_clip state dict saved with numpy.savez (fewclip-plugin-example)",
))
