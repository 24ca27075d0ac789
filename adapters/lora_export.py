"""Exported LoRA runs: peft's own format plus fewclip's metadata, or one merged open_clip state dict.

``fewclip export RUN_DIR [merge=true]`` (``fewclip.runs.export.export_run``) on a LoRA run writes a folder::

    RUN_DIR/export/
      adapter_model.safetensors   the LoRA A/B matrices, peft's key names
      adapter_config.json         peft's LoraConfig (target_modules name open_clip's module paths)
      fewclip.json                what fewclip needs to rebuild the classifier (below)
      merged.safetensors          with merge=true: the backbone's open_clip state dict with the
                                  LoRA updates folded in (same keys, shapes and dtype as the
                                  original), the same metadata under the "fewclip" key

``fewclip predict prompts=RUN_DIR/export`` (the folder) or
``prompts=RUN_DIR/export/merged.safetensors`` classifies images with either.

peft's files load with peft on the same module tree fewclip builds: the
backbone with its targeted attention split into q/k/v Linears
(``fewclip.backbones.attention.split_attention``); ``fewclip.adapters.lora`` does that.
The merged file needs no fewclip and no peft::

    import open_clip, torch
    from safetensors.torch import load_file
    model = open_clip.create_model("ViT-B-16")           # the backbone's architecture
    model.load_state_dict(load_file("merged.safetensors"))  # strict: same keys as open_clip's

and then classifies zero-shot with the run's templates (``fewclip.json``:
``templates``, ``classnames``) in the backbone's geometry.

``fewclip.json`` holds what every fewclip export carries (``format`` =
"fewclip.lora", ``format_version``, ``fewclip_version``, ``backbone``,
``geometry``, ``preprocess``, ``tokenizer``, ``classnames``, ``run``: see
``fewclip.adapter.exports``) and ``templates``, ``lora`` (the adapter config),
``trainable_parameters`` and ``tensors_sha256`` (per file, a sha256 of each
tensor, ``fewclip.utils.tensor_checks``; merged.safetensors carries its own):
loading refuses a tensor whose bytes changed since the export.
"""
from __future__ import annotations

import copy
import json
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import load_file, save_file

from fewclip.adapter.base import ExportFormat, adapter_info
from fewclip.adapter.exports import META_FILE, METADATA_KEY, ExportError
from fewclip.adapters._towers import MergedClassifier
from fewclip.backbones.backbone import BackboneError, load_state_dict_strict
from fewclip.utils.io import atomic_write, atomic_write_text
from fewclip.utils.tensor_checks import check_digests, check_tensors, tensor_digests

log = logging.getLogger(__name__)

FORMAT = "fewclip.lora"
FORMAT_VERSION = 1
MERGED_FILE = "merged.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def export_lora(adapter, out: Union[str, Path], meta: dict[str, Any], *, merge: bool = False) -> dict[str, Any]:
    """Write a LoRA adapter to the folder ``out`` (see the module docstring); ``meta`` is the metadata every
    export carries, to which the templates and the LoRA config are added. Returns the metadata written."""

    out = Path(out)
    if out.suffix == ".safetensors":
        raise ExportError(f"-o {out}: a LoRA export is a folder (peft's files, fewclip.json and, with merge=true, "
                          f"merged.safetensors inside it); give a folder path")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; a LoRA export is a folder")
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "templates": list(adapter.templates), "lora": asdict(adapter.cfg),
            "trainable_parameters": int(adapter.trainable_parameter_count())}
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # peft writes its files; move each in atomically
        adapter.save_peft(tmp)
        for name in (PEFT_WEIGHTS, PEFT_CONFIG):
            src = Path(tmp) / name
            if not src.is_file():
                raise ExportError(f"peft did not write {name}")
            src.replace(out / name)
    try:
        peft_sd = load_file(str(out / PEFT_WEIGHTS))
    except Exception as e:  # safetensors' own error: what peft just wrote does not read back
        raise ExportError(f"{out / PEFT_WEIGHTS} written by peft does not read back ({e})") from None
    check_tensors(peft_sd, f"the LoRA weights to export ({out / PEFT_WEIGHTS})", ExportError,
                  "; the run is not exported")
    digests = {PEFT_WEIGHTS: tensor_digests(peft_sd)}
    if merge:
        sd = adapter.merged_state_dict()
        digests[MERGED_FILE] = tensor_digests(sd)
        text = json.dumps({**meta, "tensors_sha256": digests[MERGED_FILE]})
        atomic_write(out / MERGED_FILE, lambda tmp: save_file(sd, tmp, metadata={METADATA_KEY: text}))
    meta = {**meta, "tensors_sha256": digests}
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2))
    return meta


def summary(path: Union[str, Path], meta: dict[str, Any]) -> str:
    lo, bb, run = meta["lora"], meta["backbone"], meta.get("run") or {}
    checksum = bb.get("weights_sha256") or bb.get("state_sha256") or ""
    lines = [
        f"LoRA export: {path}",
        f"  backbone  {bb['name']} [{meta['geometry']['name']}], checksum {checksum[:16]}...",
        f"  classes   {len(meta['classnames'])}: {', '.join(meta['classnames'])}",
        f"  templates {meta['templates']}",
        f"  LoRA      rank {lo['rank']}, alpha {lo['alpha']}, targets {lo['targets']}, towers {lo['towers']}, "
        f"layers {lo['layers']}: {meta['trainable_parameters']} parameters",
    ]
    if run.get("top1") is not None:
        lines.append(f"  run       top-1 {run['top1']:.2f}% on {run.get('dataset')} ({run.get('shots')}-shot, "
                     f"seed {run.get('seed')})")
    files = [PEFT_WEIGHTS, PEFT_CONFIG, META_FILE] + ([MERGED_FILE] if (Path(path) / MERGED_FILE).exists() else [])
    lines.append(f"  files     {', '.join(files)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------


class LoRAClassifier(MergedClassifier):
    """Images -> class logits on a backbone whose weights have the LoRA updates merged in (the prototypes of the
    run's templates through the adapted text tower; ``with_classnames`` builds them for any other names)."""

    def __repr__(self) -> str:
        lo = self.meta["lora"]
        return (f"LoRAClassifier({len(self.classnames)} classes, {self.backbone.name} [{self.geometry.name}], "
                f"rank {lo['rank']}, targets {lo['targets']}, towers {lo['towers']})")


@torch.no_grad()
def load_lora_export(path: Path, meta: dict[str, Any], backbone) -> LoRAClassifier:
    """A LoRA export folder (peft format) or its merged file as a classifier (the loader ``fewclip.load_prompts``
    calls once it has read the metadata and checked ``backbone``): the LoRA updates are merged into the
    weights of a copy of ``backbone``, which is not changed."""

    info = adapter_info("lora")  # the registry, not an import: lora.py imports this module for its format
    LoRA, LoRAConfig = info.adapter_cls, info.config_cls
    for key, typ in (("templates", list), ("lora", dict)):
        if not isinstance(meta.get(key), typ):
            raise ExportError(f"{path}: metadata key {key!r} is missing or not a {typ.__name__}")
    backbone = copy.deepcopy(backbone)
    if path.is_dir():
        weights = path / PEFT_WEIGHTS
        if not weights.is_file():
            raise ExportError(f"{path}: no {PEFT_WEIGHTS} (peft's LoRA weights) in the export folder")
        try:
            lora_cfg = LoRAConfig(**meta["lora"])
        except (TypeError, ValueError) as e:
            raise ExportError(f"{path / META_FILE}: bad 'lora' section: {e}; export the run again") from None
        adapter = LoRA(lora_cfg, backbone, meta["classnames"], meta["templates"])
        try:
            sd = load_file(str(weights))
        except Exception as e:  # safetensors' own error for a damaged file
            raise ExportError(f"{weights} is damaged or not a safetensors file ({e})") from None
        expected = meta.get("tensors_sha256")
        check_tensors(sd, str(weights), ExportError, "; export the run again")
        check_digests(sd, expected.get(PEFT_WEIGHTS) if isinstance(expected, dict) else expected, str(weights),
                      ExportError, "; export the run again")
        try:
            adapter.load_peft_state_dict(sd)
        except (ValueError, RuntimeError, KeyError) as e:
            raise ExportError(f"{weights}: {e}") from None
        merged = adapter.merged_state_dict()
        del adapter
    else:
        try:
            merged = load_file(str(path))
        except Exception as e:  # safetensors' own error types for a damaged file
            raise ExportError(f"{path} is damaged or not a safetensors file ({e})") from None
        check_tensors(merged, str(path), ExportError, "; export the run again")
        check_digests(merged, meta.get("tensors_sha256"), str(path), ExportError, "; export the run again")
    try:
        load_state_dict_strict(backbone.model, merged, str(path))
    except BackboneError as e:
        raise ExportError(str(e)) from None
    backbone.source = f"{backbone.source} + LoRA {path}"
    return LoRAClassifier(backbone, meta, path)


LORA = ExportFormat(name=FORMAT, version=FORMAT_VERSION, default_path="export", write=export_lora,
                    load=load_lora_export, summary=summary, options={"merge": False})
