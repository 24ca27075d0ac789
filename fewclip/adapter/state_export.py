"""A generic export for any adapter: its state dict and config in one ``.safetensors`` file (format
``fewclip.adapter.base``).

An adapter opts in with ``register_adapter(NAME, Config, Adapter, export=STATE)``. ``fewclip export RUN_DIR
[-o FILE]`` then writes (``fewclip.runs.export.export_run`` rebuilds the run's adapter and calls ``write``):

* tensors: the adapter's own state dict (``adapter.adapter_state_dict()``: its parameters and persistent
  buffers, exactly what the run saved in ``adapter.safetensors``);
* metadata ``"fewclip"`` (JSON): what every fewclip export carries (``format`` = ``"fewclip.adapter"``,
  ``format_version``, ``fewclip_version``, ``backbone`` with its checksum and config section, ``geometry``,
  ``preprocess``, ``tokenizer``, ``classnames``, ``run``: see ``fewclip.adapter.exports``), and ``adapter`` (``name``
  and ``config``, the adapter's config section), ``templates`` and ``tensors_sha256`` (a sha256 of each
  tensor, ``fewclip.utils.tensor_checks``: loading refuses a tensor whose bytes changed since the export).

``fewclip predict`` / ``fewclip.load_prompts`` load it as an ``AdapterClassifier``: the adapter is rebuilt
with ``build_adapter`` from its registered config class, the backbone, the class names and the templates
(buffers that the adapter derives from them, such as zero-shot prototypes, are rebuilt, not stored), and
the stored state is loaded into it. ``with_classnames`` works where the adapter ``supports_new_classes``
(``Adapter.for_classnames``); other adapters classify their own classes only.

The file needs fewclip to be used: the classifier is the adapter's own ``forward``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import load_file, save_file

from fewclip.adapter.base import AdapterError, ExportFormat, adapter_info, build_adapter
from fewclip.adapter.exports import METADATA_KEY, Classifier, ExportError
from fewclip.data.base import check_classnames
from fewclip.utils.io import atomic_write
from fewclip.utils.tensor_checks import check_digests, check_state_tensors, check_tensors, tensor_digests

FORMAT = "fewclip.adapter"
FORMAT_VERSION = 1
DAMAGED = "; export the run again"


def write_state(adapter, path: Union[str, Path], meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``adapter``'s state dict and config to ``path`` (atomically); returns the metadata written."""

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ExportError(f"-o {path}: a {FORMAT} export is one .safetensors file; give a path ending in "
                          f".safetensors")
    tensors = {k: v.contiguous() for k, v in adapter.adapter_state_dict().items()}
    check_tensors(tensors, f"the {adapter.name} adapter to export", ExportError, "; the run is not exported")
    meta = {**meta, "adapter": {"name": adapter.name, "config": asdict(adapter.cfg)},
            "templates": list(adapter.templates), "tensors_sha256": tensor_digests(tensors)}
    text = json.dumps(meta)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={METADATA_KEY: text}))
    return meta


def summary(path: Union[str, Path], meta: dict[str, Any]) -> str:
    ad, bb, run = meta["adapter"], meta["backbone"], meta.get("run") or {}
    checksum = bb.get("weights_sha256") or bb.get("state_sha256") or ""
    options = " ".join(f"{k}={v}" for k, v in ad["config"].items() if k != "name") or "no options"
    lines = [
        f"{ad['name']} export: {path}",
        f"  backbone  {bb['name']} [{meta['geometry']['name']}], checksum {checksum[:16]}...",
        f"  classes   {len(meta['classnames'])}: {', '.join(meta['classnames'])}",
        f"  templates {meta['templates']}",
        f"  adapter   {options}",
    ]
    if run.get("top1") is not None:
        lines.append(f"  run       top-1 {run['top1']:.2f}% on {run.get('dataset')} ({run.get('shots')}-shot, "
                     f"seed {run.get('seed')})")
    return "\n".join(lines)


class AdapterClassifier(Classifier):
    """Images -> logits through a rebuilt adapter (its own image tower where it adapts one)."""

    def __init__(self, backbone, meta: dict[str, Any], adapter, path: Optional[Path] = None):
        super().__init__(backbone, meta, path, adapter.classnames)
        self.adapter = adapter.eval()

    def __repr__(self) -> str:
        return (f"AdapterClassifier({self.adapter.name}, {len(self.classnames)} classes, {self.backbone.name} "
                f"[{self.geometry.name}])")

    def _scores(self, raw: torch.Tensor) -> torch.Tensor:
        """The adapter's logits, checked against the metadata's class list: a file whose tensors were made for
        other classes (its metadata edited, or another run's) is an ExportError naming it, not a shape error
        deep in the adapter."""
        n = len(self.classnames)
        try:
            out = self.adapter(raw)
        except RuntimeError as e:  # torch's shape errors; out-of-memory is not the file's fault
            if "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError":
                raise
            raise ExportError(f"{self.path}: its tensors do not fit the {n} classes its metadata lists "
                              f"({str(e).splitlines()[0]}); export the run again") from None
        if out.ndim != 2 or out.shape[1] != n:
            raise ExportError(f"{self.path}: its tensors give {out.shape[-1]} class scores but its metadata lists "
                              f"{n} classes; export the run again")
        return out

    @torch.no_grad()
    def logits_from_features(self, raw: torch.Tensor) -> torch.Tensor:
        return self._scores(raw)

    @torch.no_grad()
    def logits(self, images, batch_size: int = 256) -> torch.Tensor:
        px = self.pixels(images)
        outs = [self._scores(self.adapter.encode_images(px[i : i + batch_size].to(self.backbone.device)))
                for i in range(0, len(px), batch_size)]
        return torch.cat(outs) if outs else torch.empty(0, len(self.classnames), device=self.backbone.device)

    def with_classnames(self, classnames: Sequence[str]) -> AdapterClassifier:

        names = check_classnames(classnames, "with_classnames", warn=True)
        if not self.adapter.supports_new_classes:
            raise ExportError(f"a {self.adapter.name} export classifies its own classes only: the method learns "
                              f"one weight or cache entry per trained class")
        try:
            other = self.adapter.for_classnames(names, self.meta["templates"])
        except AdapterError as e:
            raise ExportError(str(e)) from None
        return AdapterClassifier(self.backbone, {**self.meta, "classnames": list(names)}, other, self.path)


@torch.no_grad()
def load_state(path: Path, meta: dict[str, Any], backbone) -> AdapterClassifier:
    """The classifier of a ``fewclip.adapter`` export (the loader ``fewclip.load_prompts`` calls once it has read
    the metadata and checked ``backbone``)."""

    ad = meta.get("adapter")
    if not isinstance(ad, dict) or not isinstance(ad.get("name"), str) or not isinstance(ad.get("config"), dict):
        raise ExportError(f"{path}: metadata key 'adapter' must hold the adapter's name and config; export the "
                          f"run again")
    if not isinstance(meta.get("templates"), list):
        raise ExportError(f"{path}: metadata key 'templates' is missing or not a list; export the run again")
    try:
        info = adapter_info(ad["name"])
    except ValueError as e:
        raise ExportError(f"{path} was exported from adapter {ad['name']!r}, which this fewclip does not have "
                          f"({e})") from None
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(info.config_cls), ad["config"]))
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ExportError(f"{path}: the stored {ad['name']} config does not fit this fewclip's: {e}") from None
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors' own error for a damaged file
        raise ExportError(f"{path} is damaged or not a safetensors file ({e})") from None
    check_tensors(tensors, str(path), ExportError, DAMAGED)  # NaN named as such, before the checksums
    adapter = build_adapter(cfg, backbone, meta["classnames"], meta["templates"])
    check_state_tensors(tensors, adapter.adapter_state_dict(), str(path), ExportError, DAMAGED)
    try:
        adapter.load_adapter_state_dict(tensors)  # copied into the adapter's tensors on its device
    except RuntimeError as e:
        raise ExportError(f"{path}: its tensors do not fit a {ad['name']} adapter: {e}") from None
    check_digests(tensors, meta.get("tensors_sha256"), str(path), ExportError, DAMAGED)
    return AdapterClassifier(backbone, meta, adapter, path)


STATE = ExportFormat(name=FORMAT, version=FORMAT_VERSION, default_path="adapter_export.safetensors",
                     write=write_state, load=load_state, summary=summary)
