"""A backbone with no towers: a geometry and a table of text features (methods on features you already have).

What the methods that train on cached features ask of a backbone is small: its ``geometry`` (how raw features
become points, how prototypes average, how logits are formed) and, for the class prototypes, the text tower's
output for each prompt (``encode_text``). A ``FeatureBackbone`` is exactly that: a geometry and a table from
each prompt (a template filled with a class name) to its raw text-tower output. Image features come from
elsewhere (a feature file, ``fewclip.features.feature_file``; tensors, ``fewclip.training.on_features``), so it has no
image tower, and no text tower to run on new words or on learned prompt vectors.

A method that needs a tower (prompt learning runs the text tower on context vectors; LoRA and deep prompts
change the towers; anything that encodes images) fails on it with ``TowerMissing``, and
``fewclip.training.on_features.check_runs_on_features`` turns that into one line naming the method and why, before a run starts.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from fewclip.backbones.geometry import Geometry


class TowerMissing(ValueError, AttributeError):
    """A method asked a ``FeatureBackbone`` for a tower it does not have (an ``AttributeError`` too, so that
    ``getattr(backbone, name, default)`` and ``hasattr`` keep working). This module imports nothing of fewclip's
    but the geometry: the feature-file dataset builds on it."""


class FeatureBackbone:
    """A geometry and a text table: ``text`` [C, T, D] raw text-tower outputs of ``templates`` (T of them, each
    with one ``{}``) filled with ``classnames`` (C of them). ``weights_sha256`` identifies where the features came
    from (a feature file's sha256): runs on other features are other runs."""

    def __init__(self, geometry: Geometry, classnames: Sequence[str], templates: Sequence[str], text: Tensor, *,
                 name: str = "features", weights_sha256: Optional[str] = None, source: str = "",
                 feature_dim: Optional[int] = None, info: Optional[dict[str, Any]] = None):
        if text.dim() == 2:
            text = text[:, None, :]
        C, T, D = text.shape
        if C != len(classnames) or T != len(templates):
            raise ValueError(f"text features [{C}, {T}, {D}] do not match {len(classnames)} class names and "
                             f"{len(templates)} templates")
        self.geometry = geometry
        self.classnames = list(classnames)
        self.templates = list(templates)
        self.text = text.float()
        self.table = {t.format(c): self.text[i, j] for i, c in enumerate(self.classnames)
                      for j, t in enumerate(self.templates)}
        self.name = name
        self.weights_sha256 = weights_sha256
        self.source = source
        self.feature_dim = int(feature_dim if feature_dim is not None else D)
        self.info = dict(info or {})
        # What the engine reads for augmented views (a feature file holds its views ready-made) and exports.
        self.image_size, self.mean, self.std = 0, (), ()
        self.tokenizer_spec: dict[str, Any] = {}
        self.local_attention: dict[str, Any] = {}
        self.variant = ""
        self.feature_file: Optional[str] = None  # the file it was read from (set by the feature-file dataset)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def to(self, *args, **kwargs) -> FeatureBackbone:
        return self

    def encode_text(self, texts: Sequence[str], batch_size: int = 1024) -> Tensor:
        """The stored raw text features [N, D] of these prompts (each a template filled with a class name)."""
        missing = [t for t in texts if t not in self.table]
        if missing:
            raise TowerMissing(f"the text tower (to encode {missing[0]!r}): a feature backbone holds the text "
                               f"features of its {len(self.classnames)} class names with its "
                               f"{len(self.templates)} template(s) only")
        return torch.stack([self.table[t] for t in texts]) if texts else torch.empty(0, self.text.shape[-1])

    def stored_class_text(self, classnames: Sequence[str], templates: Sequence[str]) -> Optional[Tensor]:
        """The stored [C, T, D] where asked for exactly these classes and templates: each class's own row, by its
        label, even where two classes share a name (``encode_text`` looks prompts up by their text); else None."""
        if list(classnames) == self.classnames and list(templates) == self.templates:
            return self.text
        return None

    def encode_images(self, pixels: Tensor) -> Tensor:
        raise TowerMissing("the image tower: a feature backbone has image features only, no images or tower")

    def preprocess(self):
        raise TowerMissing("the image tower's preprocessing: a feature backbone has no images")

    def __getattr__(self, name: str):
        # model, tokenizer, tokenize, text tower pieces: whatever runs a tower
        if name.startswith("__"):
            raise AttributeError(name)
        raise TowerMissing(f"the backbone's towers (backbone.{name}): a feature backbone has a geometry and text "
                           f"features only")

    @property
    def identity_extra(self) -> dict[str, Any]:
        """What an export records besides name and checksum: the feature file to rebuild this backbone from."""
        return {"feature_file": self.feature_file} if self.feature_file else {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "geometry": self.geometry.name,
                "geometry_params": self.geometry.params(), "weights_sha256": self.weights_sha256,
                "feature_dim": self.feature_dim, "features": self.info or None}


def content_sha256(text: Tensor, geometry: Geometry) -> str:
    """A checksum of what a feature backbone is made of (its text features and geometry), for one built from
    tensors rather than a file."""
    h = hashlib.sha256(text.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(json.dumps([geometry.name, geometry.params()], sort_keys=True).encode())
    return h.hexdigest()
