"""Methods that change the frozen towers' own weights (shared plumbing of CLIP-SVD and LoRA's layout).

``TowerWeightsAdapter`` works on a *copy* of the backbone's module tree whose tensors are the backbone's
own (``shared_copy``: nothing is duplicated and the backbone is never modified, so a sweep reuses it). A
subclass replaces modules of that copy (``replace_module``) and registers the replacements on itself, so
``parameters()``, ``train()`` and the state dict cover exactly its learnable tensors. The base class
scores the run's class prompts through the copy's text tower, in the backbone's geometry: the text
features are embedded and averaged per class exactly as zero-shot's prototypes are, so a method whose
replacement starts as the identity starts at zero-shot in every geometry.

Only the text tower changed: ``forward(features)`` takes cached features of the frozen image tower (the
run's feature store). Image tower changed (``trains_image_tower``): the engine calls
``encode_images(pixels)``.

Export (``TOWER``, ``fewclip export RUN_DIR [merge=true]``): the generic ``fewclip.adapter`` file (the
adapter's state dict and config, ``_state_export``); with ``merge=true`` also ``<name>.merged.safetensors``
beside it, the backbone's plain open_clip state dict with the method folded into the weights
(``merged_state_dict()``: same keys, shapes and dtypes as the original), which a freshly built open_clip
model loads strictly::

    model = open_clip.create_model("ViT-B-16"); model.load_state_dict(load_file("x.merged.safetensors"))

``fewclip predict`` reads either file (the merged one as zero-shot prototypes of the run's templates
through the merged towers).
"""
from __future__ import annotations

import copy
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from fewclip.adapter.base import Adapter, AdapterError, ExportFormat
from fewclip.adapter.exports import METADATA_KEY, ExportError, PrototypeClassifier
from fewclip.adapter.state_export import FORMAT as STATE_FORMAT
from fewclip.adapter.state_export import FORMAT_VERSION as STATE_VERSION
from fewclip.adapter.state_export import load_state, write_state
from fewclip.adapter.state_export import summary as state_summary
from fewclip.adapters._text import TextTower
from fewclip.backbones.attention import parse_layers, split_attention, text_tower_parts, vision_tower_parts
from fewclip.backbones.backbone import BackboneError, load_state_dict_strict
from fewclip.data.base import check_classnames
from fewclip.features.encode import text_prototypes
from fewclip.utils.io import atomic_write
from fewclip.utils.tensor_checks import check_digests, check_tensors, tensor_digests

DEFAULT_TEMPLATE = "a photo of a {}."

log = logging.getLogger(__name__)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer tensor with ``model``."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def tower_blocks(model: nn.Module, tower: str):
    """(module-name prefix, blocks) of one tower ("text" or "vision") of an open_clip model."""
    if tower == "text":
        transformer, _ = text_tower_parts(model)
    else:
        transformer, _, _ = vision_tower_parts(model)
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(transformer.resblocks)], transformer.resblocks


# The Linears of a block a method may adapt, and the towers it may adapt (LoRA, CLIP-SVD).
TARGETS = ("q", "k", "v", "o", "mlp")
TOWERS = ("text", "vision", "both")


def target_list(targets: str) -> list[str]:
    """``"q,k, v"`` -> ``["q", "k", "v"]``."""
    return [t.strip() for t in targets.split(",") if t.strip()]


def check_tower_targets(targets: str, towers: str, layers: str) -> None:
    """The ``adapter.targets``, ``towers`` and ``layers`` of a method that changes tower Linears; a bad one is a
    ValueError naming the key and the allowed values."""
    chosen = target_list(targets)
    if not chosen or any(t not in TARGETS for t in chosen):
        raise ValueError(f"adapter.targets={targets!r}: use a comma list of {', '.join(TARGETS)}")
    if towers not in TOWERS:
        raise ValueError(f"adapter.towers must be one of {TOWERS}, got {towers!r}")
    try:
        parse_layers(layers, None)
    except ValueError as e:
        raise ValueError(str(e).replace("local_attention layers", "adapter.layers")) from None


# The Linears of an open_clip residual block that each target names (after split_attention for q, k, v and o:
# nn.MultiheadAttention reads out_proj.weight directly instead of calling out_proj, so a wrapper on it would
# never run; SplitAttention calls it).
TARGET_MODULES = {"q": ("attn.q_proj",), "k": ("attn.k_proj",), "v": ("attn.v_proj",), "o": ("attn.out_proj",),
                  "mlp": ("mlp.c_fc", "mlp.c_proj")}


def target_linears(model: nn.Module, towers: str, layers: str, targets: Sequence[str], method: str) -> list[str]:
    """Split the targeted blocks' attention (in place: give it a copy) and list the full names of the Linears a
    method adapts: in each tower of ``towers`` (text, vision or both), the blocks ``layers`` names, the modules
    of each target (``TARGET_MODULES``). A tower that is not an open_clip transformer, a layer that does not
    exist or a target that is not an nn.Linear is an AdapterError naming ``method`` and the fix."""
    names: list[str] = []
    for tower in (["text", "vision"] if towers == "both" else [towers]):
        try:
            prefix, blocks = tower_blocks(model, tower)
        except ValueError as e:
            other = {"text": "vision", "vision": "text"}[tower]
            raise AdapterError(f"{method} on the {tower} tower needs an open_clip transformer there: {e}; adapt "
                               f"only the other tower with adapter.towers={other}") from None
        try:
            chosen = parse_layers(layers, len(blocks))
        except ValueError as e:
            raise AdapterError(f"adapter.towers={towers}: {e}") from None
        if any(t in ("q", "k", "v", "o") for t in targets):
            try:
                split_attention([blocks[i] for i in chosen])
            except ValueError as e:
                raise AdapterError(f"{method} on the {tower} tower: {e}") from None
        names += [f"{prefix}.{i}.{sub}" for i in chosen for t in targets for sub in TARGET_MODULES[t]]
    own = dict(model.named_modules())
    for n in names:
        if not isinstance(own.get(n), nn.Linear):
            raise AdapterError(f"{method} target {n} is not an nn.Linear in this backbone "
                               f"({type(own.get(n)).__name__}); choose other adapter.targets")
    return names


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted module path ``name`` of ``root``."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


class TowerPrototypes:
    """Class prototypes through a text tower that a method may change (LoRA, the tower-weight methods): the
    geometry's prototype of every class prompt's embedding, computed once (in float32) where the text tower stays
    frozen. Needs ``text_features()``, ``adapts_text`` and ``_fixed_protos`` (None to recompute)."""

    def prototypes(self) -> torch.Tensor:
        g = self.backbone.geometry
        if not self.adapts_text:
            if self._fixed_protos is None or self._fixed_protos.device != self.backbone.device:
                # computed once, in float32 even when first asked for inside an autocast training step
                with torch.no_grad(), torch.autocast(self.backbone.device.type, enabled=False):
                    self._fixed_protos = self._protos(g).float()
            return self._fixed_protos
        return self._protos(g)

    def _protos(self, g) -> torch.Tensor:
        emb = g.embed_text(self.text_features())
        C, T = len(self.classnames), len(self.templates)
        return g.prototype(emb.reshape(C, T, -1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw image features -> [B, C]
        return self.backbone.geometry.image_logits(features, self.prototypes())


class TowerWeightsAdapter(TowerPrototypes, Adapter):
    """Base of the methods that change the towers' weights (module docstring). A subclass builds
    ``self.model`` (a ``shared_copy`` it modifies), sets ``adapts_text`` and ``trains_image_tower`` and
    implements ``merged_state_dict``."""

    uses_text_tower = True
    # The changed towers score any class names: the prototypes of their prompts through the changed text tower.
    supports_new_classes = True

    def __init__(self, cfg, backbone, classnames: Sequence[str], templates: Sequence[str], model: nn.Module, *,
                 adapts_text: bool, trains_image_tower: bool):
        super().__init__(cfg, backbone, classnames, templates)
        if not self.classnames:
            raise AdapterError(f"adapter {self.name!r} needs at least one class name")
        if not self.templates:
            self.templates = [DEFAULT_TEMPLATE]
        bad = [t for t in self.templates if t.count("{}") != 1]
        if bad:
            raise ValueError(f"each prompt template needs exactly one '{{}}' for the class name; bad: {bad}")
        self.adapts_text = adapts_text
        self.trains_image_tower = trains_image_tower
        self.keep_outside("model", model)  # not a submodule: its frozen tensors are the backbone's
        self.keep_outside("tower", TextTower(model, backbone.tokenizer))
        texts = [t.format(c) for c in self.classnames for t in self.templates]
        tokens = backbone.tokenize(texts)
        if self.tower.can_truncate:  # cut to the longest prompt where that is exact
            L = int((tokens != self.tower.pad_id).sum(dim=1).max())
            L = max(L, int(tokens.argmax(dim=1).max()) + 1)
            tokens = tokens[:, :L]
        # on the backbone's device from the start: __init__ may already run the text tower (2SFS's classifier)
        self.register_buffer("tokens", tokens.to(backbone.device), persistent=False)
        self._fixed_protos: Optional[torch.Tensor] = None

    # -- towers --------------------------------------------------------------
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw features [B, D] from the (changed) image tower; gradients flow when enabled."""
        bb = self.backbone
        return self.model.encode_image(pixels.to(bb.device, bb.dtype)).float()

    def text_features(self) -> torch.Tensor:
        """Raw text features [C*T, D] of every class prompt through the (changed) text tower."""
        return self.tower.forward(self.tower.embed(self.tokens), self.tokens)

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> TowerWeightsAdapter:
        """The changed towers with the prototypes of other class names and templates (a new adapter of this
        class on its own copy of the module tree, holding these tensors)."""
        if list(classnames) == self.classnames and (list(templates) or [DEFAULT_TEMPLATE]) == self.templates:
            return self
        return self.rebuilt_for(classnames, templates)

    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    def load_adapter_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        super().load_adapter_state_dict(sd)
        self._fixed_protos = None

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The backbone's open_clip state dict with this method folded into the weights (same keys)."""
        raise NotImplementedError

    def _check_merged(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        own = self.backbone.model.state_dict()
        if sorted(sd) != sorted(own):
            raise RuntimeError(f"merged {self.name} state dict does not have the backbone's keys")
        out = {k: sd[k].detach().to("cpu", own[k].dtype).contiguous() for k in own}
        bad = [k for k, v in out.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise ExportError(f"the merged {self.name} weights are not finite ({bad[:3]}); the run is not exported")
        return out


# ---------------------------------------------------------------------------
# export: the generic adapter file, and with merge=true a plain open_clip state dict
# ---------------------------------------------------------------------------

FORMAT = "fewclip.tower"  # the merged file's format; the adapter file is STATE_FORMAT
FORMAT_VERSION = 1


def merged_path(path: Union[str, Path]) -> Path:
    path = Path(path)
    return path.with_name(path.name[: -len(".safetensors")] + ".merged.safetensors")


def write_tower(adapter, path: Union[str, Path], meta: dict[str, Any], *, merge: bool = False) -> dict[str, Any]:
    """The generic ``fewclip.adapter`` file at ``path``; with ``merge`` also the merged open_clip state dict
    beside it (``merged_path``). Returns the adapter file's metadata."""

    written = write_state(adapter, path, {**meta, "format": STATE_FORMAT, "format_version": STATE_VERSION})
    if merge:
        sd = adapter.merged_state_dict()
        mmeta = {**written, "format": FORMAT, "format_version": FORMAT_VERSION, "merged": True,
                 "trainable_parameters": int(adapter.trainable_parameter_count()),
                 "tensors_sha256": tensor_digests(sd)}
        atomic_write(merged_path(path), lambda tmp: save_file(sd, tmp, metadata={METADATA_KEY: json.dumps(mmeta)}))
        log.info("merged into a plain open_clip state dict: %s", merged_path(path))
    return written


def summary(path: Union[str, Path], meta: dict[str, Any]) -> str:

    text = state_summary(path, meta)
    if merged_path(path).exists():
        text += f"\n  merged    {merged_path(path)} (plain open_clip state dict)"
    return text


class MergedClassifier(PrototypeClassifier):
    """Images -> logits on a backbone whose weights hold the method: zero-shot prototypes of the run's
    templates through the merged towers; ``with_classnames`` builds them for any other names."""

    def __init__(self, backbone, meta: dict[str, Any], path: Optional[Path] = None,
                 classnames: Optional[Sequence[str]] = None):

        names = list(classnames if classnames is not None else meta["classnames"])
        super().__init__(backbone, {**meta, "classnames": names}, text_prototypes(backbone, names, meta["templates"]),
                         path)

    def __repr__(self) -> str:
        return (f"MergedClassifier({self.meta['adapter']['name']}, {len(self.classnames)} classes, "
                f"{self.backbone.name} [{self.geometry.name}])")

    def with_classnames(self, classnames: Sequence[str]) -> MergedClassifier:

        return type(self)(self.backbone, self.meta, self.path, check_classnames(classnames, "with_classnames", warn=True))


@torch.no_grad()
def load_tower(path: Path, meta: dict[str, Any], backbone):
    """A merged file as a ``MergedClassifier`` on a copy of ``backbone`` (which is not changed)."""

    if not meta.get("merged"):
        return load_state(path, meta, backbone)
    if not isinstance(meta.get("templates"), list) or not isinstance(meta.get("adapter"), dict):
        raise ExportError(f"{path}: metadata keys 'templates' and 'adapter' are missing; export the run again")
    try:
        sd = load_file(str(path))
    except Exception as e:  # safetensors' own error for a damaged file
        raise ExportError(f"{path} is damaged or not a safetensors file ({e})") from None
    check_tensors(sd, str(path), ExportError, "; export the run again")
    check_digests(sd, meta.get("tensors_sha256"), str(path), ExportError, "; export the run again")
    backbone = copy.deepcopy(backbone)
    try:
        load_state_dict_strict(backbone.model, sd, str(path))
    except BackboneError as e:
        raise ExportError(str(e)) from None
    backbone.source = f"{backbone.source} + {meta['adapter']['name']} {path}"
    return MergedClassifier(backbone, meta, path)


TOWER = ExportFormat(name=FORMAT, version=FORMAT_VERSION, default_path="adapter_export.safetensors",
                     write=write_tower, load=load_tower, summary=summary, options={"merge": False})
