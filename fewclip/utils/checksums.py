"""Checksums of files, bytes and model state, used by run records, the feature store and exports."""
from __future__ import annotations

import hashlib
import os
import weakref

import torch


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def state_sha256(model: torch.nn.Module) -> str:
    """A checksum of a model's state dict (names, shapes, float32 values), for weights without a file checksum."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu()
        t = (t.float() if t.is_floating_point() else t).contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


_STATE_SHA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_checksum(backbone) -> str:
    """The backbone's weights file sha256, or the sha256 of its state dict where it has no file.

    The state-dict checksum is computed once per backbone object, when first asked (a sweep asks before
    any run, so an adapter that changes the towers in place cannot change it)."""
    if getattr(backbone, "weights_sha256", None):
        return f"file:{backbone.weights_sha256}"
    if backbone not in _STATE_SHA:
        _STATE_SHA[backbone] = f"state:{state_sha256(backbone.model)}"
    return _STATE_SHA[backbone]
