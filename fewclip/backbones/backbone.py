"""The one door to CLIP: load a frozen backbone of any geometry.

A backbone is named by ``BackboneConfig.name`` and resolved in this order:

1. a path to a backbone card (``*.yaml``), or a folder holding one (``card.yaml``, as
   ``fewclip import`` writes it);
2. the name of a card shipped with fewclip (``toy-clip``, ``toy-euclip``, ...);
3. an open_clip architecture (``ViT-B-32``) with ``backbone.pretrained`` set to an
   open_clip pretrained tag (``openai``, ``laion2b_s34b_b79k``, ...), a local
   checkpoint file, or ``none`` for random weights.

A *backbone card* is a small YAML file describing a checkpoint that open_clip's
tags do not cover, e.g. a model trained in another geometry::

    name: my-meru-vit-s
    architecture: ViT-S-16          # an open_clip built-in config, or
    # model_config: {...}           # an inline open_clip model config, or
    # model_config_file: cfg.json   # an open_clip model-config JSON (relative to the card)
    # image_tower: {...}            # an image tower open_clip cannot name (fewclip.backbones.towers), with
                                    # model_config giving embed_dim and text_cfg only
    final_ln: true                  # false: no final LayerNorm in either tower (EuCLIP)
    weights: meru_vit_s.safetensors # relative to the card; .safetensors, or .pt/.bin (loaded weights_only)
    tokenizer: {type: open_clip}    # or {type: word, file: vocab.json}, or {type: hf, name: HUB_ID, path: DIR}
    geometry: {name: hyperbolic, logit_scale: 10.0, curvature: 1.0, alpha_image: 0.05, alpha_text: 0.05}
    preprocess: {resize_mode: shortest, interpolation: bicubic, mean: [...], std: [...], fill_color: 0}
                                     # optional, each field defaults to open_clip's (fewclip.backbones.preprocess)
    sha256: ...                      # optional; checked when present

The geometry gives every parameter: ``logit_scale`` always (and it must agree with the
weights' own ``logit_scale``, stored as its log, within the weights' precision),
``logit_bias`` for ``sigmoid`` (checked against the weights' bias when they hold one),
``curvature``, ``alpha_image`` and ``alpha_text`` for the hyperbolic geometries. A
missing or disagreeing parameter is an error, never a default.

Weights are never unpickled: safetensors files are read with ``safetensors``,
TorchScript archives by ``fewclip.backbones.torchscript`` (tensors only, no code run),
anything else with ``torch.load(weights_only=True)``. Weights must be finite floats
(a quantized or NaN checkpoint is refused). The model is frozen (no parameter
requires grad) and kept in eval mode.
"""
from __future__ import annotations

import json
import logging
import math
import pickle
import re
import warnings
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import open_clip
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from open_clip.factory import convert_state_dict, get_model_config
from open_clip.model import CLIP, CustomTextCLIP
from safetensors.torch import load_file

from fewclip.backbones.attention import apply_local_attention
from fewclip.backbones.fingerprints import identify
from fewclip.backbones.geometry import (  # noqa: F401
    GEOMETRIES,
    GEOMETRY_ALIASES,
    REQUIRED_GEOMETRY_PARAMS,
    UNSUPPORTED_GEOMETRIES,
    Geometry,
    canonical_geometry,
    geometry_of_open_clip,
    geometry_params,
    make_geometry,
)
from fewclip.backbones.names import backbone_hint
from fewclip.backbones.preprocess import OPENAI_MEAN, OPENAI_STD, PreprocessConfig, PreprocessError, disagreeing_tags
from fewclip.backbones.tokenizer import TokenizerNotFound, WordTokenizer, load_hf_tokenizer
from fewclip.backbones.torchscript import TorchScriptError, archive_prefix, read_torchscript_state_dict
from fewclip.backbones.towers import TimmTowerCLIP
from fewclip.config.sections import DEVICE_PATTERN, PRECISIONS, BackboneConfig, LocalAttentionConfig, backbone_config_from_dict  # noqa: F401  (re-exported)
from fewclip.utils.checksums import sha256_file
from fewclip.utils.errors import InputError
from fewclip.utils.logs import quiet_open_clip
from fewclip.utils.rng import forked_global_rng

log = logging.getLogger(__name__)

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference"
class BackboneError(InputError):
    """A backbone that cannot be resolved or loaded; the message says what to do."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackboneError(f"backbone.device={device!r} but CUDA is not available; use backbone.device=cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BackboneError(f"backbone.device={device!r} but there are {torch.cuda.device_count()} CUDA device(s); "
                            f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise BackboneError(f"backbone.device={device!r} but MPS is not available; use backbone.device=cpu or auto")
    return dev


def _dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


# Keys OpenAI's CLIP checkpoints carry besides the weights (OpenAI's build_model deletes them).
OPENAI_EXTRA_KEYS = ("input_resolution", "context_length", "vocab_size")
# Geometry parameters that EuCLIP's hyperbolic models store in the state dict, as logs.
EUCLIP_GEOMETRY_KEYS = ("alpha_img", "alpha_txt", "curvature")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_checkpoint(path: str | Path) -> Any:
    """What a checkpoint file holds (a dict, usually), read without executing code from it.

    ``.safetensors`` with safetensors; a TorchScript archive (OpenAI's published CLIP files)
    with fewclip's tensor-only reader, giving its state dict; anything else with
    ``torch.load(weights_only=True)``. A file that holds pickled objects is refused with the
    conversion a user can run themselves, knowing that it runs the file's code.
    """

    path = Path(path)
    if not path.is_file():
        raise BackboneError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":

        try:
            return load_file(str(path), device="cpu")
        except Exception as e:  # safetensors' own error types for a damaged or foreign file
            raise BackboneError(f"cannot read safetensors file {path}: {e}") from None
    if archive_prefix(path) is not None:
        try:
            return read_torchscript_state_dict(path)
        except TorchScriptError as e:
            raise BackboneError(f"cannot read TorchScript archive {path}: {e}. {_conversion_hint(path)}") from None
    _check_zip_crc(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols; the refusal below says what matters
            warnings.simplefilter("ignore")
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message advises weights_only=False; fewclip never does that, so say only what was found.
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
        what = f"pickled Python objects (the first: {found.group(1)})" if found else \
            "pickled data other than plain tensors"
        raise BackboneError(
            f"refusing to load {path}: it holds {what}, which fewclip does not rebuild (that would run code from "
            f"the file). fewclip "
            f"reads .safetensors, torch files loadable with torch.load(weights_only=True) (tensors only) and "
            f"TorchScript archives (tensors only). {_conversion_hint(path, found.group(1) if found else '')}"
        ) from None
    except Exception as e:  # torch.load raises many types (RuntimeError, EOFError, ...) for a damaged file
        raise BackboneError(
            f"cannot read weights file {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            f"fewclip reads .safetensors, torch files that hold only tensors, and TorchScript archives") from None


def _check_zip_crc(path: Path) -> None:
    """A torch zip checkpoint's records against their own CRC-32 (torch's reader does not compare them, so
    bytes changed inside a tensor would load as weights); the TorchScript reader gets this from ``zipfile``."""
    if not zipfile.is_zipfile(path):
        return  # torch's legacy (non-zip) format: no checksums to compare
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:  # a truncated or mangled archive
        raise BackboneError(f"weights file {path} is a damaged zip archive ({e}); download or copy it again") from None
    if bad is not None:
        raise BackboneError(f"weights file {path} is damaged: its record {bad!r} does not match the CRC-32 stored "
                            f"with it; download or copy it again")


def _conversion_hint(path: Path, global_name: Optional[str] = None) -> str:
    """How a user who trusts ``path`` can turn it into safetensors themselves (fewclip never runs a file's code)."""
    save = ("from safetensors.torch import save_file; "
            "save_file({k: v.float().contiguous() for k, v in sd.items()}, 'weights.safetensors')")
    if global_name == "":  # not a class torch names: nothing to allowlist
        return ("Save the bare state dict (torch.save(model.state_dict(), path)) or a .safetensors file from the "
                "program that wrote it")
    if global_name is None:  # a TorchScript archive this reader could not parse
        return (f"If you trust the file, convert it once yourself, knowing that torch.jit.load compiles and runs "
                f"the code stored in it: python -c \"import torch; sd = torch.jit.load('{path}', "
                f"map_location='cpu').state_dict(); {save}\" and give fewclip weights.safetensors")
    module, _, name = global_name.rpartition(".")
    return (f"If you trust the file, convert it once yourself, allowing torch to rebuild {global_name} objects "
            f"(this runs that code; repeat for any further class torch names): python -c \"import torch, {module}; "
            f"torch.serialization.add_safe_globals([{global_name}]); ck = torch.load('{path}', map_location='cpu'); "
            f"sd = ck.get('state_dict', ck.get('model', ck)); {save}\" and give fewclip weights.safetensors, or save "
            f"the bare state dict (torch.save(model.state_dict(), path)) from the program that wrote the file")


def load_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A flat state dict from ``path`` (see ``read_checkpoint``), unwrapped from open_clip_train's
    ``{"state_dict": ...}`` and stripped of DistributedDataParallel's ``module.`` prefix."""
    sd = read_checkpoint(path)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict) and "curv" in sd["model"]:
        raise BackboneError(f"{path} is a MERU/HyCoCLIP training checkpoint ({{'model': ...}}); import it into a "
                            f"card folder: fewclip import meru {path} arch=TIMM_VIT_NAME out=DIR")
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise BackboneError(f"weights file {path} does not hold a flat state dict of tensors")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def check_weights_are_finite_floats(sd: dict[str, torch.Tensor], keys: Sequence[str], source: str) -> None:
    """Refuse weights that are not float16/bfloat16/float32/float64 (quantized, int8) or not finite."""
    bad_dtype = [f"{k} ({sd[k].dtype})" for k in keys if sd[k].dtype not in FLOAT_DTYPES]
    if bad_dtype:
        raise BackboneError(
            f"weights in {source} are not floating point where the model's are: {len(bad_dtype)} tensors, e.g. "
            f"{bad_dtype[:3]}. fewclip loads float16/bfloat16/float32 checkpoints; a quantized (int8, fp8) checkpoint "
            f"must be dequantized to float first")
    bad = [k for k in keys if not bool(torch.isfinite(sd[k]).all())]
    if bad:
        raise BackboneError(
            f"weights in {source} hold NaN or infinite values in {len(bad)} tensors (e.g. {bad[:3]}): the file is "
            f"damaged or the training diverged; use another checkpoint")


def load_state_dict_strict(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Load ``sd`` into ``model``; any missing, unexpected or mis-shaped tensor is an error naming ``source``,
    and so is a non-float or non-finite tensor where the model holds floats."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    bad_shape = [f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                 for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        if bad_shape:
            parts.append(f"{len(bad_shape)} with the wrong shape (e.g. {bad_shape[:3]})")
        raise BackboneError(
            f"weights in {source} do not match the declared architecture: " + "; ".join(parts)
            + ". Check that the card's architecture/model_config is the one these weights were trained with."
        )
    check_weights_are_finite_floats(sd, [k for k, v in own.items() if v.is_floating_point()], source)
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k].to(v.dtype))


# ---------------------------------------------------------------------------
# The Backbone object
# ---------------------------------------------------------------------------


class Backbone(nn.Module):
    """A frozen open_clip model plus its tokenizer, geometry and preprocessing.

    ``encode_images`` and ``encode_text`` return *raw* tower outputs in float32;
    ``geometry.embed_image`` / ``embed_text`` map them into the geometry's space.
    ``text`` exposes the text tower's pieces for prompt-learning adapters.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Callable,
        geometry: Geometry,
        *,
        name: str,
        image_size: Optional[int] = None,
        mean: Sequence[float] = OPENAI_MEAN,
        std: Sequence[float] = OPENAI_STD,
        weights_sha256: Optional[str] = None,
        source: str = "",
        tokenizer_spec: Optional[dict] = None,
        preprocess: Optional[PreprocessConfig] = None,
    ):
        super().__init__()
        self.model = model
        self.geometry = geometry
        self.tokenizer = tokenizer
        self.name = name
        # The evaluation preprocessing (fewclip.backbones.preprocess); image_size/mean/std alone mean open_clip's default
        # resize (shorter side, bicubic, centre crop).
        if preprocess is None:
            preprocess = PreprocessConfig(size=int(image_size), mean=tuple(mean), std=tuple(std))
        self.preprocess_cfg = preprocess
        self.image_size = preprocess.size
        self.mean = preprocess.mean
        self.std = preprocess.std
        self.weights_sha256 = weights_sha256
        self.source = source
        self.tokenizer_spec = tokenizer_spec or {}
        # What was changed in the towers' attention (fewclip.backbones.attention.apply_local_attention); {} = nothing.
        self.local_attention: dict[str, Any] = {}
        self._variants: dict[str, Any] = {}  # tower_variant's views of this backbone, made once
        self.freeze()

    # -- trainability ------------------------------------------------------
    def freeze(self) -> Backbone:
        for p in self.parameters():
            p.requires_grad_(False)
        super().train(False)
        return self

    def train(self, mode: bool = True) -> Backbone:  # the backbone stays in eval mode
        return self

    # -- properties --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.visual.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.tokenizer, "context_length", None) or self.model_context_length)

    @property
    def model_context_length(self) -> int:
        m = self.model
        return int(m.context_length if hasattr(m, "context_length") else m.text.context_length)

    def preprocess(self):
        """The evaluation transform: PIL image -> normalised tensor (``preprocess_cfg``, through open_clip)."""
        return self.preprocess_cfg.transform()

    # -- encoding ----------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(texts), context_length=self.model_context_length)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw image-tower outputs [B, D] (float32) for a batch of preprocessed images."""
        pixels = pixels.to(self.device, self.dtype)
        return self.model.encode_image(pixels).float()

    def image_projection(self) -> Optional[torch.Tensor]:
        """The image tower's last linear map [W, D] (open_clip's ViT ``visual.proj``), or None where the tower
        has none of that form (a ResNet's attention pool, a timm head)."""
        proj = getattr(self.model.visual, "proj", None)
        return proj if isinstance(proj, torch.Tensor) and proj.dim() == 2 else None

    def image_head(self) -> Optional[tuple]:
        """The image tower's last linear map as ``(P [W, D], b [D] or None)``, ``encode_images = z @ P (+ b)`` on
        the features z before it: open_clip's ViT ``visual.proj`` (no bias), or a ModifiedResNet's attention-pool
        output projection ``visual.attnpool.c_proj`` (P its weight transposed, b its bias); None for other towers.
        ``image_projection`` is the ViT's alone (the feature store derives the plain features from it)."""
        proj = self.image_projection()
        if proj is not None:
            return proj, None
        c_proj = _attnpool_c_proj(self.model.visual)
        return (c_proj.weight.t(), c_proj.bias) if c_proj is not None else None

    @torch.no_grad()
    def encode_images_preproj(self, pixels: torch.Tensor) -> torch.Tensor:
        """The image tower's features before its projection [B, W] (float32): ``encode_images = this @ P (+ b)``
        (``image_head``). open_clip's ViT applies ``proj`` last when it is not None, so the tower runs with it set
        aside (open_clip has no public switch for this). A ModifiedResNet's attention pool applies ``c_proj``
        inside its attention call, so the tower runs with ``c_proj`` an identity map of the attention's width and a
        zero bias: the attention's output before the projection, computed as ProLIP's authors compute it
        (astra-vision/ProLIP @ b43e795 ``clip/model.py``, ``AttentionPool2d.forward``)."""
        visual = self.model.visual
        proj = self.image_projection()
        c_proj = _attnpool_c_proj(visual) if proj is None else None
        if proj is None and c_proj is None:
            raise BackboneError(f"backbone {self.name}: its image tower has no linear projection (a ViT's "
                                f"visual.proj, a ModifiedResNet's attnpool.c_proj) whose input fewclip can take; "
                                f"use a ViT or ModifiedResNet tower")
        pixels = pixels.to(self.device, self.dtype)
        if proj is not None:
            visual.proj = None
            try:
                return visual(pixels).float()
            finally:
                visual.proj = proj
        w = c_proj.weight
        identity = nn.Module()  # what the pool reads of c_proj: weight and bias (not nn.Linear: no random init drawn)
        identity.weight = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
        identity.bias = torch.zeros(w.shape[1], dtype=w.dtype, device=w.device)
        visual.attnpool.c_proj = identity
        try:
            return visual(pixels).float()
        finally:
            visual.attnpool.c_proj = c_proj

    def tower_variant(self, name: str) -> Backbone:
        """This backbone with its image tower's output replaced: ``"preproj"`` gives the features before the
        projection (ProLIP trains the projection on them). The feature cache and store key features by
        ``variant``, so they are kept apart from the plain ones and encoded once per image and view."""
        if name != "preproj":
            raise BackboneError(f"unknown tower variant {name!r}; the one there is: preproj")
        if self.image_head() is None:
            raise BackboneError(f"backbone {self.name}: its image tower has no linear projection (a ViT's "
                                f"visual.proj, a ModifiedResNet's attnpool.c_proj) whose input fewclip can take; "
                                f"use a ViT or ModifiedResNet tower")
        variants = self.__dict__.setdefault("_variants", {})  # (a backbone unpickled from before has none)
        if "preproj" not in variants:
            variants["preproj"] = _PreProjection(self)
        return variants["preproj"]

    def stored_variant(self) -> Optional[_PreProjection]:
        """The tower variant whose features the feature cache and store keep for this backbone's: the
        pre-projection variant where the image tower ends in a linear projection (the projected features are
        derived from them by ``project_features``, so one encoding of an image serves ProLIP and every other
        method); None where the tower's own output is kept (a ModifiedResNet's too: its projection runs inside the
        attention pool, so the plain features are encoded and kept as they are, and ProLIP's apart)."""
        return self.tower_variant("preproj") if self.image_projection() is not None else None

    @torch.no_grad()
    def project_features(self, z: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """``encode_images``'s output [N, D] (float32, CPU) from the features before the projection z [N, W]:
        ``z @ image_projection()`` in the tower's precision and on its device, in the batches the features were
        encoded in (the tower's own product; z holds the tower's values exactly, float32 holding bf16/fp16)."""
        proj = self.image_projection()
        if proj is None:
            raise BackboneError(f"backbone {self.name}: its image tower has no linear projection (visual.proj)")
        with torch.autocast(self.device.type, enabled=False):  # the tower's precision, whatever the caller runs under
            out = [(z[i : i + batch_size].to(self.device, self.dtype) @ proj).float().cpu()
                   for i in range(0, z.shape[0], batch_size)]
        return torch.cat(out) if out else z.new_zeros(0, proj.shape[1])

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], batch_size: int = 1024) -> torch.Tensor:
        """Raw text-tower outputs [N, D] (float32)."""
        out = []
        for i in range(0, len(texts), batch_size):
            tokens = self.tokenize(texts[i : i + batch_size]).to(self.device)
            out.append(self.model.encode_text(tokens).float())
        return torch.cat(out)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "geometry": self.geometry.name,
            "geometry_params": self.geometry.params(),
            "weights_sha256": self.weights_sha256,
            "image_size": self.image_size,
            "preprocess": self.preprocess_cfg.to_dict(),
            "tokenizer": self.tokenizer_spec,
            "local_attention": self.local_attention or None,
        }

    @property
    def variant(self) -> str:
        """A key for what changes the features besides the weights (empty for the plain backbone)."""

        return json.dumps(self.local_attention, sort_keys=True) if self.local_attention else ""


def _attnpool_c_proj(visual) -> Optional[nn.Linear]:
    """A ModifiedResNet's attention-pool output projection (open_clip's ``AttentionPool2d.c_proj``), or None."""
    from open_clip.modified_resnet import AttentionPool2d

    pool = getattr(visual, "attnpool", None)
    c_proj = getattr(pool, "c_proj", None)
    return c_proj if isinstance(pool, AttentionPool2d) and isinstance(c_proj, nn.Linear) else None


class _PreProjection:
    """A backbone whose image tower stops before its projection (``Backbone.tower_variant("preproj")``): every
    attribute is the backbone's, except ``encode_images`` (features [B, W] before the projection) and
    ``variant`` (which keys them apart in the feature cache and store)."""

    def __init__(self, backbone: Backbone):
        object.__setattr__(self, "base", backbone)

    def __getattr__(self, name: str):
        if name == "base" or name.startswith("__"):  # not set yet (a copy being made): not the backbone's
            raise AttributeError(name)
        return getattr(self.base, name)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.base.encode_images_preproj(pixels)

    def stored_variant(self) -> None:
        return None  # its own output is what the store keeps

    @property
    def variant(self) -> str:
        return f"{self.base.variant}|preproj"


# ---------------------------------------------------------------------------
# Cards
# ---------------------------------------------------------------------------


def shipped_cards() -> dict[str, Path]:
    """Cards shipped with fewclip: name -> path."""
    return {p.stem: p for p in sorted(REFERENCE_DIR.glob("*.yaml"))}


CARD_FILE = "card.yaml"  # the card inside a card folder (what `fewclip import` writes)


def card_file(path: str | Path) -> Path:
    """The card YAML that ``path`` names: the file itself, or the card inside a card folder."""
    path = Path(path)
    if not path.is_dir():
        return path
    if (path / CARD_FILE).is_file():
        return path / CARD_FILE
    found = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml"))
    if len(found) == 1:
        return found[0]
    raise BackboneError(f"folder {path} holds {'no' if not found else len(found)} card files; a card folder holds "
                        f"{CARD_FILE} (as `fewclip import` writes it) or exactly one .yaml card")


def is_card_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or Path(name).is_dir()


def read_card(path: str | Path) -> dict[str, Any]:

    path = card_file(path)
    if not path.is_file():
        raise BackboneError(f"backbone card not found: {path}")
    try:
        card = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # YAML's and omegaconf's errors (any type) for a card that does not parse
        raise BackboneError(f"cannot parse backbone card {path}: {e}") from None
    if not isinstance(card, dict):
        raise BackboneError(f"backbone card {path} must be a YAML mapping")
    allowed = {"name", "description", "architecture", "model_config", "model_config_file", "image_tower", "weights",
               "tokenizer", "geometry", "preprocess", "sha256", "trained_with", "final_ln", "imported_from"}
    unknown = sorted(set(card) - allowed)
    if unknown:
        raise BackboneError(f"backbone card {path} has unknown keys {unknown}; allowed: {sorted(allowed)}")
    n_arch = sum(k in card for k in ("architecture", "model_config", "model_config_file"))
    if n_arch != 1:
        raise BackboneError(
            f"backbone card {path} must give exactly one of 'architecture' (an open_clip model name), "
            f"'model_config' (inline) or 'model_config_file' (a JSON file)"
        )
    for key in ("weights", "geometry"):
        if key not in card:
            raise BackboneError(f"backbone card {path} is missing the '{key}' key")
    if "image_tower" in card and ("architecture" in card or "vision_cfg" in (card.get("model_config") or {})):
        raise BackboneError(f"backbone card {path}: with 'image_tower', give 'model_config' with embed_dim and "
                            f"text_cfg only (the image tower is the card's image_tower)")
    card["_dir"] = str(path.resolve().parent)
    card["_path"] = str(path.resolve())
    return card


def _card_model_config(card: dict[str, Any]) -> dict[str, Any]:

    if "architecture" in card:
        cfg = get_model_config(card["architecture"])
        if cfg is None:
            raise BackboneError(f"card {card['_path']}: unknown open_clip architecture {card['architecture']!r}")
        return cfg
    if "model_config" in card:
        return dict(card["model_config"])
    p = Path(card["_dir"]) / card["model_config_file"]
    if not p.is_file():
        raise BackboneError(f"card {card['_path']}: model_config_file not found: {p}")
    try:
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:  # not JSON, or not UTF-8 text (UnicodeDecodeError is a ValueError)
        raise BackboneError(f"card {card['_path']}: model_config_file {p} is not JSON ({e}); fix or replace it") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_cfg", cfg), dict):
        raise BackboneError(f"card {card['_path']}: model_config_file {p} is not a JSON object (a model config)")
    return cfg.get("model_cfg", cfg)


def remove_final_ln(model: nn.Module) -> nn.Module:
    """Drop the final LayerNorm of both towers (the EuCLIP recipe; card key ``final_ln: false``)."""
    if not hasattr(model.visual, "ln_post"):
        raise BackboneError(f"final_ln: false needs an open_clip VisionTransformer image tower, not "
                            f"{type(model.visual).__name__}")
    model.visual.ln_post = nn.Identity()
    if hasattr(model, "ln_final"):
        model.ln_final = nn.Identity()
    else:
        model.text.ln_final = nn.Identity()
    return model


def build_open_clip_model(model_cfg: dict[str, Any], image_tower: Optional[dict[str, Any]] = None) -> nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a model config dict (random init), or with
    ``image_tower`` a ``fewclip.backbones.towers.TimmTowerCLIP`` (that image tower, open_clip's text tower)."""
    cfg = dict(model_cfg)
    if image_tower is not None:

        cfg.pop("custom_text", None)
        return TimmTowerCLIP(image_tower=dict(image_tower), **cfg)

    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in cfg.get("text_cfg", {})
    cls = CustomTextCLIP if custom_text else CLIP
    return cls(**cfg)


def model_tokenizer(model_cfg: dict[str, Any], arch: Optional[str], folder: Optional[str | Path], where: str):
    """(tokenizer, spec) for an open_clip model config, loaded before the model.

    A config naming a Hugging Face tokenizer (``text_cfg.hf_tokenizer_name``) gets it from
    ``folder`` or the local Hugging Face cache, never the hub (``fewclip.backbones.tokenizer.load_hf_tokenizer``);
    otherwise open_clip's own tokenizer for ``arch`` (CLIP's BPE for an inline config).
    """

    text_cfg = model_cfg.get("text_cfg", {}) or {}
    ctx = int(text_cfg.get("context_length", 77))
    hub_id = text_cfg.get("hf_tokenizer_name")
    if hub_id:
        try:
            tok = load_hf_tokenizer(hub_id, folder, ctx, text_cfg.get("tokenizer_kwargs"),
                                    text_cfg.get("tokenizer_mode"))
        except (TokenizerNotFound, ValueError) as e:
            raise BackboneError(f"{where}: {e}") from None
        return tok, {"type": "hf", "name": hub_id, "context_length": ctx}
    if folder is not None:
        raise BackboneError(f"{where}: backbone.tokenizer={folder} is set, but this model uses open_clip's own "
                            f"tokenizer, not a Hugging Face one; unset backbone.tokenizer")
    if arch:
        return open_clip.get_tokenizer(arch), {"type": "open_clip", "name": arch}
    tok = open_clip.tokenizer.SimpleTokenizer(context_length=ctx, **(text_cfg.get("tokenizer_kwargs") or {}))
    return tok, {"type": "open_clip", "name": None}


def _card_tokenizer(card: dict[str, Any], model_cfg: dict[str, Any], override: Optional[str] = None):
    spec = dict(card.get("tokenizer") or {"type": "open_clip"})
    kind = spec.get("type", "open_clip")
    ctx = model_cfg.get("text_cfg", {}).get("context_length", 77)
    where = f"card {card['_path']}"
    if kind == "word":

        if override is not None:
            raise BackboneError(f"{where} has its own word tokenizer; unset backbone.tokenizer")
        p = Path(card["_dir"]) / spec["file"]
        if not p.is_file():
            raise BackboneError(f"card {card['_path']}: tokenizer file not found: {p}")
        tok = WordTokenizer.load(p)
        tok.context_length = ctx
        vocab = model_cfg.get("text_cfg", {}).get("vocab_size")
        if vocab is not None and vocab != tok.vocab_size:
            raise BackboneError(
                f"card {card['_path']}: tokenizer {p} has {tok.vocab_size} tokens but the model's "
                f"text_cfg.vocab_size is {vocab}"
            )
        return tok, {"type": "word", "vocab": tok.words, "context_length": ctx}
    if kind == "hf":
        cfg = {**model_cfg, "text_cfg": dict(model_cfg.get("text_cfg", {}))}
        cfg["text_cfg"]["hf_tokenizer_name"] = spec.get("name") or cfg["text_cfg"].get("hf_tokenizer_name")
        if not cfg["text_cfg"]["hf_tokenizer_name"]:
            raise BackboneError(f"{where}: tokenizer type 'hf' needs 'name' (the Hugging Face hub id)")
        folder = override if override is not None else (Path(card["_dir"]) / spec["path"] if spec.get("path")
                                                         else None)
        return model_tokenizer(cfg, None, folder, where)
    if kind == "open_clip":
        name = spec.get("name") or card.get("architecture")
        return model_tokenizer(model_cfg, name, override, where)
    raise BackboneError(f"card {card['_path']}: tokenizer type must be 'word', 'open_clip' or 'hf', got {kind!r}")


def _weights_scalar(sd: dict[str, torch.Tensor], key: str) -> Optional[torch.Tensor]:
    t = sd.get(key)
    return None if t is None else t.detach().reshape(-1)[:1]


def _agrees(value: float, stored: torch.Tensor) -> bool:
    """Whether ``value`` equals the stored scalar to the precision it is stored in (at least 1e-4 relative)."""
    s = float(stored.float())
    tol = max(1e-4, 2 * torch.finfo(stored.dtype).eps) * max(1.0, abs(s))
    return abs(value - s) <= tol


def card_geometry(card: dict[str, Any], sd: dict[str, torch.Tensor]) -> Geometry:
    """The card's geometry, every parameter given and the logit scale and bias agreeing with the weights'."""
    where = f"card {card['_path']}"
    params = dict(card["geometry"])
    name = params.pop("name", None)
    if name is None:
        raise BackboneError(f"{where}: geometry needs a 'name'")
    try:
        name = canonical_geometry(str(name))
        allowed = geometry_params(name)
    except ValueError as e:
        raise BackboneError(f"{where}: {e}") from None
    stored_scale, stored_bias = _weights_scalar(sd, "logit_scale"), _weights_scalar(sd, "logit_bias")
    required = REQUIRED_GEOMETRY_PARAMS.get(name, ("logit_scale",))
    missing = [k for k in required if k not in params]
    if missing:
        found = f" (the weights hold logit_scale = {math.exp(float(stored_scale.float())):.6g})" \
            if "logit_scale" in missing and stored_scale is not None else ""
        raise BackboneError(
            f"{where}: geometry {name!r} needs {list(required)}, and the card does not give {missing}{found}; "
            f"fewclip uses no default for a frozen backbone's geometry. Add them to the card's geometry section "
            f"(`fewclip import` reads them from the authors' checkpoint)")
    if "logit_scale" in params and stored_scale is not None and "logit_scale" in allowed:
        if not _agrees(math.log(float(params["logit_scale"])), stored_scale):
            weights = math.exp(float(stored_scale.float()))
            raise BackboneError(
                f"{where}: geometry.logit_scale is {params['logit_scale']} but the weights hold logit_scale = "
                f"{weights:.6g} (stored as its log, {float(stored_scale.float()):.6g}); set "
                f"geometry.logit_scale: {weights:.8g} in the card, or fix the weights")
    if "logit_bias" in params and stored_bias is not None and not _agrees(float(params["logit_bias"]), stored_bias):
        raise BackboneError(
            f"{where}: geometry.logit_bias is {params['logit_bias']} but the weights hold logit_bias = "
            f"{float(stored_bias.float()):.6g}; set geometry.logit_bias: {float(stored_bias.float()):.8g} in the card")
    try:
        return make_geometry(name, **params)
    except ValueError as e:
        raise BackboneError(f"{where}: {e}") from None


def load_card(card_path: str | Path, cfg: BackboneConfig) -> Backbone:
    card = read_card(card_path)
    model_cfg = _card_model_config(card)
    # The tokenizer first: a missing one is an error in seconds, before a large model is built.
    tokenizer, tok_spec = _card_tokenizer(card, model_cfg, cfg.tokenizer)
    weights = Path(card["_dir"]) / card["weights"]
    if not weights.is_file():
        raise BackboneError(f"card {card['_path']}: weights file not found: {weights}")
    digest = sha256_file(weights)
    if card.get("sha256") and card["sha256"] != digest:
        raise BackboneError(
            f"weights file {weights} has sha256 {digest[:16]}... but card {card['_path']} declares "
            f"{str(card['sha256'])[:16]}...: the file is damaged or not the one the card describes"
        )
    try:
        model = build_open_clip_model(model_cfg, card.get("image_tower"))
    except Exception as e:  # open_clip/timm raise any type for a config they cannot build: it is the card's
        raise BackboneError(f"card {card['_path']}: cannot build the model from its config: {e}") from None
    if card.get("final_ln", True) is False:
        remove_final_ln(model)
    sd = load_weights_file(weights)
    if not card.get("image_tower"):  # weights a fingerprint recognises must be in the activation they were trained in
        refusal = known_weights_error(identify(sd), f"card {card['_path']}", weights,
                                      bool(model_cfg.get("quick_gelu", False)))
        if refusal:
            raise BackboneError(refusal.replace("Use backbone=", "Give the card architecture: "))
    load_state_dict_strict(model, sd, str(weights))
    geometry = card_geometry(card, sd)
    if card.get("image_tower"):
        image_size = card["image_tower"]["image_size"]
    else:
        image_size = model_cfg["vision_cfg"].get("image_size", 224)
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    try:
        preprocess = PreprocessConfig.from_mapping(card.get("preprocess"), int(image_size), "preprocess")
    except PreprocessError as e:
        raise BackboneError(f"card {card['_path']}: {e}") from None
    log.info("loaded %s: weights %s (sha256 %s...), %s geometry; images: %s", card.get("name", card_path), weights,
             digest[:12], geometry.name, preprocess.describe())
    bb = Backbone(
        model,
        tokenizer,
        geometry,
        name=card.get("name", card_file(card_path).stem),
        preprocess=preprocess,
        weights_sha256=digest,
        source=str(card_path),
        tokenizer_spec=tok_spec,
    )
    return _place(bb, cfg)


# ---------------------------------------------------------------------------
# open_clip architectures
# ---------------------------------------------------------------------------


def _geometry_for_open_clip(model: nn.Module, override: Optional[str]) -> Geometry:
    scale = float(model.logit_scale.detach().float().exp().reshape(-1)[0])
    bias = getattr(model, "logit_bias", None)
    if override is None:
        override = geometry_of_open_clip(bias is not None)
    try:
        override = canonical_geometry(override)
    except ValueError as e:
        raise BackboneError(f"backbone.geometry: {e}") from None
    if override in ("hyperbolic", "hyperbolic_sq"):
        raise BackboneError(
            f"backbone.geometry={override} needs a curvature and per-modality scales, which an open_clip "
            f"architecture does not carry (fewclip would otherwise use curvature 1 and alpha 1). Import the "
            f"checkpoint that holds them (`fewclip import euclip FILE model=ARCH geometry={override} out=DIR`, "
            f"or `fewclip import meru ...`) and use backbone=DIR, or write a backbone card giving them")
    params: dict[str, float] = {"logit_scale": scale}
    if override == "sigmoid":
        if bias is None:
            raise BackboneError(
                "backbone.geometry=sigmoid needs a logit bias, and this model has none (no init_logit_bias in its "
                "config). Use a SigLIP architecture, or a card giving geometry.logit_bias")
        params["logit_bias"] = float(bias.detach().float().reshape(-1)[0])
    try:
        return make_geometry(override, **params)
    except ValueError as e:
        raise BackboneError(f"backbone.geometry: {e}") from None


def final_ln_hint(arch: str, sd_keys, model_keys, path: Path) -> str:
    """A hint naming the right architecture when the only mismatch is the final LayerNorms ("" otherwise)."""
    sd_keys, model_keys = set(sd_keys), set(model_keys)
    ln = {k for k in model_keys | sd_keys if k.startswith(("ln_final.", "visual.ln_post.", "text.ln_final."))}
    if not ln or (sd_keys ^ model_keys) - ln:
        return ""
    if ln <= model_keys and not ln & sd_keys:
        return (f" The file has no final LayerNorms: it was trained with the EuCLIP fork's {arch}-no-final-ln; import "
                f"it: fewclip import euclip {path} model={arch}-no-final-ln geometry=... out=DIR")
    if ln <= sd_keys and not ln & model_keys and arch.endswith("-no-final-ln"):
        return f" The file has final LayerNorms: use model={arch[:-len('-no-final-ln')]}"
    return ""


def known_weights_error(known, arch: str, path: Path, quick_gelu: bool) -> Optional[str]:
    """The refusal of an open_clip architecture whose activation contradicts a recognised published checkpoint."""
    if known is None or known.quick_gelu is None or known.quick_gelu == quick_gelu:
        return None
    act = "QuickGELU" if known.quick_gelu else "GELU"
    return (f"{path} holds the published weights {known.name} (recognised by their fingerprint), trained with {act}; "
            f"{arch} uses {'GELU' if known.quick_gelu else 'QuickGELU'}, so its logits would be silently wrong. Use "
            f"backbone={known.architecture}")


def _check_open_clip_file(arch: str, sd: dict[str, torch.Tensor], path: Path, known=None) -> dict[str, torch.Tensor]:
    """Refuse files whose layout (or fingerprint, ``known``) says they need more than an open_clip architecture."""

    quick_gelu = bool((get_model_config(arch) or {}).get("quick_gelu", False))
    if any(k in sd for k in EUCLIP_GEOMETRY_KEYS):
        raise BackboneError(
            f"{path} holds EuCLIP's hyperbolic geometry parameters ({', '.join(EUCLIP_GEOMETRY_KEYS)}), which an "
            f"open_clip architecture has no place for. Import it: fewclip import euclip {path} model={arch} "
            f"geometry=hyperbolic|hyperbolic-squared out=DIR, then backbone=DIR")
    refusal = known_weights_error(known, arch, path, quick_gelu)
    if refusal:
        raise BackboneError(refusal)
    if any(k in sd for k in OPENAI_EXTRA_KEYS):
        if not quick_gelu:
            raise BackboneError(
                f"{path} is an OpenAI CLIP checkpoint (it carries {', '.join(OPENAI_EXTRA_KEYS)}): OpenAI's towers "
                f"use QuickGELU, and {arch} uses GELU, so its logits would be silently wrong. Use "
                f"backbone={arch}-quickgelu, or import it (fewclip import openai {path} out=DIR)")
        sd = {k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS}
    return sd


def _open_clip_image_size(model_cfg: dict[str, Any]) -> int:
    size = (model_cfg.get("vision_cfg") or {}).get("image_size", 224)
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _file_preprocess(arch: str, size: int, path: Path, known) -> PreprocessConfig:
    """The preprocessing of a local file on the open_clip route: the tag's, for a published checkpoint that its
    fingerprint recognises; else open_clip's default, where every published tag of ``arch`` agrees with it."""

    if known is not None and known.tag:
        tag_arch = known.architecture if open_clip.get_pretrained_cfg(known.architecture, known.tag) else arch
        return PreprocessConfig.for_open_clip_tag(tag_arch, known.tag, size)
    default = PreprocessConfig(size=size)
    others = disagreeing_tags(arch, size, default)
    if others:  # a file does not say which weights it holds, so not how their images were preprocessed
        raise BackboneError(
            f"open_clip's published weights for {arch} are preprocessed otherwise than its default ({'; '.join(others)}), "
            f"and a local file does not say which weights it holds. Import it naming them: fewclip import open_clip "
            f"{path} model={arch} pretrained=TAG out=DIR (or resize_mode=, interpolation=, mean=R,G,B, std=R,G,B for "
            f"weights of your own), then backbone=DIR")
    return default


def load_open_clip(cfg: BackboneConfig) -> Backbone:

    arch = cfg.name
    pretrained = cfg.pretrained
    if pretrained is None:
        tags = [t for m, t in open_clip.list_pretrained() if m == arch]
        raise BackboneError(
            f"backbone={arch} is an open_clip architecture: say which weights with backbone.pretrained=TAG "
            f"(known tags: {', '.join(tags) or 'none'}), a local checkpoint file, or none (random weights)"
        )
    model_cfg = get_model_config(arch) or {}
    # The tokenizer first: a Hugging Face tokenizer that is not on this machine fails here, in seconds.
    with quiet_open_clip():
        tokenizer, tok_spec = model_tokenizer(model_cfg, arch, cfg.tokenizer, f"backbone={arch}")
    weights_sha = None
    size = _open_clip_image_size(model_cfg)
    if pretrained.lower() == "none":
        with quiet_open_clip(), forked_global_rng(cfg.seed):  # open_clip would log "No pretrained weights loaded"
            model = open_clip.create_model(arch, pretrained=None)
        source = f"open_clip:{arch} (random init, backbone.seed={cfg.seed})"
        preprocess = PreprocessConfig(size=size)
        log.info("backbone %s: random weights (backbone.pretrained=none), backbone.seed=%d", arch, cfg.seed)
    elif Path(pretrained).exists():
        p = Path(pretrained)
        sd = load_weights_file(p)
        known = identify(sd)
        preprocess = _file_preprocess(arch, size, p, known)
        sd = _check_open_clip_file(arch, sd, p, known)
        with quiet_open_clip():  # "No pretrained weights loaded" would be wrong: fewclip loads them below
            model = open_clip.create_model(arch, pretrained=None)
        try:
            sd = convert_state_dict(model, sd)
        except Exception:  # conversion is best effort; the strict check below decides
            pass
        if "logit_scale" in sd and sd["logit_scale"].ndim != model.logit_scale.ndim:
            sd["logit_scale"] = sd["logit_scale"].reshape(model.logit_scale.shape)
        hint = final_ln_hint(arch, sd, model.state_dict(), p)
        try:
            load_state_dict_strict(model, sd, str(p))
        except BackboneError as e:
            raise BackboneError(f"{e}{hint}") from None
        weights_sha = sha256_file(p)
        source = f"open_clip:{arch} weights={p}"
        log.info("backbone %s: weights %s (sha256 %s...%s); images: %s", arch, p, weights_sha[:12],
                 f", recognised as {known.name}" if known else "", preprocess.describe())
    else:
        known_tags = open_clip.list_pretrained_tags_by_model(arch)
        if pretrained not in known_tags:
            raise BackboneError(
                f"backbone.pretrained={pretrained!r} is neither a local file nor a known open_clip tag for {arch} "
                f"(known: {', '.join(known_tags) or 'none'})"
            )
        tag_cfg = open_clip.get_pretrained_cfg(arch, pretrained)
        if tag_cfg.get("quick_gelu") and not model_cfg.get("quick_gelu", False):
            # open_clip only warns (a UserWarning) and builds GELU towers for weights trained with QuickGELU
            raise BackboneError(
                f"open_clip's {arch}/{pretrained} weights were trained with QuickGELU and {arch} uses GELU, so its "
                f"logits would be silently wrong; use backbone={arch}-quickgelu backbone.pretrained={pretrained}")
        preprocess = PreprocessConfig.for_open_clip_tag(arch, pretrained, size)
        try:
            with quiet_open_clip():
                model = open_clip.create_model(arch, pretrained=pretrained, cache_dir=cfg.cache_dir, weights_only=True)
        except Exception as e:  # open_clip's download/load errors (RuntimeError, OSError, HTTP errors...)
            raise BackboneError(
                f"could not load open_clip weights {arch}/{pretrained}: {e}. Without network access, download the "
                f"checkpoint elsewhere and pass its path: backbone.pretrained=/path/to/open_clip_model.safetensors"
            ) from None
        source = f"open_clip:{arch}/{pretrained}"
        log.info("backbone %s: open_clip weights %s; images: %s", arch, pretrained, preprocess.describe())
    image_size = getattr(model.visual, "image_size", size)
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    if int(image_size) != preprocess.size:
        preprocess = PreprocessConfig.from_mapping(preprocess.card_section(), int(image_size))
    bb = Backbone(
        model,
        tokenizer,
        _geometry_for_open_clip(model, cfg.geometry),
        name=arch if pretrained.lower() == "none" else f"{arch}/{Path(pretrained).name}",
        preprocess=preprocess,
        weights_sha256=weights_sha,
        source=source,
        tokenizer_spec=tok_spec,
    )
    return _place(bb, cfg)


def _place(bb: Backbone, cfg: BackboneConfig) -> Backbone:
    device = resolve_device(cfg.device)
    dtype = _dtype(cfg.precision)
    bb.model.to(device=device, dtype=dtype)
    bb.geometry.to(device=device)  # geometry math stays in float32
    if cfg.local_attention.active:
        try:
            bb.local_attention = apply_local_attention(bb.model, cfg.local_attention)
        except ValueError as e:
            raise BackboneError(f"backbone.local_attention: {e}") from None
    return bb.freeze()


def load_backbone(cfg: BackboneConfig) -> Backbone:
    """Resolve ``cfg.name`` (card path or folder, shipped card, open_clip architecture) and load it frozen."""
    name = cfg.name
    cards = shipped_cards()
    if is_card_path(name) or name in cards:
        if cfg.pretrained is not None:
            raise BackboneError(
                f"backbone.pretrained={cfg.pretrained} applies to open_clip architectures, and backbone={name} is a "
                f"card, which names its own weights: unset backbone.pretrained, or import those weights into a card "
                f"of their own (`fewclip import`)")
        if cfg.geometry is not None:
            raise BackboneError(f"backbone.geometry applies to open_clip architectures; the card {name} gives its "
                                f"geometry (edit its geometry section instead)")
        return load_card(cards.get(name, name), cfg)

    if name in open_clip.list_models():
        return load_open_clip(cfg)
    raise BackboneError(
        f"unknown backbone {name!r}: {backbone_hint(name, list(cards), open_clip.list_models())}not a card file or "
        f"folder, not a shipped card "
        f"({', '.join(cards) or 'none shipped'}), and not an open_clip architecture. `fewclip backbones` lists "
        f"what can be loaded."
    )


def list_backbones() -> list[dict[str, str]]:
    """What can be loaded: shipped cards with their geometry, then open_clip architectures and tags."""

    rows = []
    for name, path in shipped_cards().items():
        try:
            card = read_card(path)
            rows.append({"name": name, "kind": "card", "geometry": str(card["geometry"].get("name")),
                         "weights": card["weights"], "description": card.get("description", "")})
        except BackboneError as e:
            rows.append({"name": name, "kind": "card", "geometry": "?", "weights": "", "description": f"broken: {e}"})
    tags: dict[str, list[str]] = {}
    for arch, tag in open_clip.list_pretrained():
        tags.setdefault(arch, []).append(tag)
    for arch in open_clip.list_models():
        cfg = open_clip.factory.get_model_config(arch) or {}
        geom = geometry_of_open_clip(cfg.get("init_logit_bias") is not None)
        rows.append({"name": arch, "kind": "open_clip", "geometry": geom,
                     "weights": ", ".join(tags.get(arch, [])) or "none", "description": ""})
    return rows


def describe_backbone_source(name: str) -> str:
    """What ``backbone=NAME`` loads, without loading it: a card's weights, geometry, tokenizer and image
    preprocessing; an open_clip architecture's published tags with the preprocessing and activation of each."""

    cards = shipped_cards()
    if is_card_path(name) or name in cards:
        card = read_card(cards.get(name, name))
        model_cfg = _card_model_config(card)
        size = card["image_tower"]["image_size"] if card.get("image_tower") else _open_clip_image_size(model_cfg)
        try:
            pre = PreprocessConfig.from_mapping(card.get("preprocess"), int(size), "preprocess")
        except PreprocessError as e:
            raise BackboneError(f"card {card['_path']}: {e}") from None
        geometry = dict(card["geometry"])
        lines = [f"{card.get('name', name)} (card {card['_path']})",
                 f"  weights: {Path(card['_dir']) / card['weights']}",
                 f"  geometry: {geometry.pop('name', '?')} " + ", ".join(f"{k}={v}" for k, v in geometry.items()),
                 f"  tokenizer: {card.get('tokenizer') or {'type': 'open_clip'}}",
                 f"  images: {pre.describe()}"]
        if card.get("imported_from"):
            lines.append(f"  imported from: {card['imported_from'].get('format')} {card['imported_from'].get('checkpoint')}")
        return "\n".join(lines)
    model_cfg = get_model_config(name)
    if model_cfg is None:
        raise BackboneError(f"unknown backbone {name!r}: not a card file or folder, not a shipped card, and not an "
                            f"open_clip architecture; `fewclip backbones` lists what can be loaded")
    size = _open_clip_image_size(model_cfg)
    quick = bool(model_cfg.get("quick_gelu", False))
    geom = "sigmoid" if model_cfg.get("init_logit_bias") is not None else "clip"
    lines = [f"{name} (open_clip architecture, {'QuickGELU' if quick else 'GELU'}, {geom} geometry, {size}px)"]
    for tag in open_clip.list_pretrained_tags_by_model(name):
        tag_quick = bool(open_clip.get_pretrained_cfg(name, tag).get("quick_gelu", False))
        # (only open_clip's explicit flag counts: a tag without it says nothing about its activation)
        note = f"  [trained with QuickGELU: use backbone={name}-quickgelu]" if tag_quick and not quick else ""
        lines.append(f"  backbone.pretrained={tag}: {PreprocessConfig.for_open_clip_tag(name, tag, size).describe()}"
                     f"{note}")
    default = PreprocessConfig(size=size)
    others = disagreeing_tags(name, size, default)
    lines.append(f"  backbone.pretrained=none: {default.describe()} (open_clip's default)")
    lines.append("  backbone.pretrained=FILE: " + (
        f"refused unless the file is recognised (tags preprocessed otherwise: {len(others)}); import it with "
        f"fewclip import open_clip FILE model={name} pretrained=TAG out=DIR" if others else
        f"{default.describe()} (open_clip's default, as every published tag)"))
    return "\n".join(lines)
