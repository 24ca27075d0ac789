"""The one door to CLIP: load a frozen backbone of any geometry.

A backbone is named by ``BackboneConfig.name`` and resolved in this order:

1. a path to a backbone card (``*.yaml``);
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
    weights: meru_vit_s.safetensors # relative to the card; .safetensors, or .pt/.bin (loaded weights_only)
    tokenizer: {type: open_clip}    # or {type: word, file: vocab.json}
    geometry: {name: hyperbolic, logit_scale: 10.0, curvature: 1.0, alpha_image: 0.05, alpha_text: 0.05}
    preprocess: {mean: [...], std: [...]}   # optional, defaults to OpenAI CLIP's
    sha256: ...                      # optional; checked when present

Weights are never unpickled: safetensors files are read with ``safetensors``,
anything else with ``torch.load(weights_only=True)``. The model is frozen (no
parameter requires grad) and kept in eval mode.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .attention import LocalAttentionConfig, apply_local_attention
from .geometry import Geometry, make_geometry

log = logging.getLogger(__name__)

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


class BackboneError(ValueError):
    """A backbone that cannot be resolved or loaded; the message says what to do."""


@dataclass
class BackboneConfig:
    """The ``backbone`` section of a run config."""

    # A card path, a shipped card name, or an open_clip architecture name.
    name: str = "toy-clip"
    # For open_clip architectures: a pretrained tag, a local checkpoint file, or "none" (random init).
    pretrained: Optional[str] = None
    # Geometry override for open_clip architectures (default: clip, or sigmoid when the model has a logit bias).
    geometry: Optional[str] = None
    precision: str = "fp32"
    # "auto" picks CUDA when available, else the CPU.
    device: str = "auto"
    cache_dir: Optional[str] = None
    # Local-window self-attention in the frozen towers (fewclip.attention), e.g. local_attention.text.window=8.
    local_attention: LocalAttentionConfig = field(default_factory=LocalAttentionConfig)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"backbone.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"backbone.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")


def backbone_config_from_dict(d: Dict[str, Any]) -> BackboneConfig:
    """A ``BackboneConfig`` from a plain dict (nested sections included), checked like a config file."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BackboneConfig), d))
    except OmegaConfBaseException as e:
        raise ValueError(str(e).splitlines()[0]) from None


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


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def load_weights_file(path: str | Path) -> Dict[str, torch.Tensor]:
    """Read a state dict without executing pickled code."""
    path = Path(path)
    if not path.is_file():
        raise BackboneError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path), device="cpu")
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message suggests weights_only=False; fewclip never does that, so say only what was found.
        detail = " ".join(str(e).split("WeightsUnpickler error:", 1)[-1].split())
        for cut in (" was not an allowed global", ". Please use", " Check the documentation"):
            detail = detail.split(cut)[0]
        what = "pickled Python objects, not only tensors" if "global" in detail.lower() else "no readable state dict"
        raise BackboneError(
            f"refusing to load weights file {path}: it holds {what} ({detail}). fewclip reads .safetensors, or "
            f"torch files loadable with torch.load(weights_only=True) and never runs pickled code: save the bare "
            f"state dict (torch.save(model.state_dict(), path)) or convert it to .safetensors"
        ) from None
    except Exception as e:
        raise BackboneError(
            f"cannot read weights file {path}: {e}. fewclip reads .safetensors, or torch files loadable with "
            f"weights_only=True (plain tensors, no pickled objects)"
        ) from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise BackboneError(f"weights file {path} does not hold a flat state dict of tensors")
    if sd and next(iter(sd)).startswith("module."):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def load_state_dict_strict(model: nn.Module, sd: Dict[str, torch.Tensor], source: str) -> None:
    """Load ``sd`` into ``model``; any missing, unexpected or mis-shaped tensor is an error naming ``source``."""
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
        image_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        weights_sha256: Optional[str] = None,
        source: str = "",
        tokenizer_spec: Optional[dict] = None,
    ):
        super().__init__()
        self.model = model
        self.geometry = geometry
        self.tokenizer = tokenizer
        self.name = name
        self.image_size = int(image_size)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.weights_sha256 = weights_sha256
        self.source = source
        self.tokenizer_spec = tokenizer_spec or {}
        # What was changed in the towers' attention (fewclip.attention.apply_local_attention); {} = nothing.
        self.local_attention: Dict[str, Any] = {}
        self.freeze()

    # -- trainability ------------------------------------------------------
    def freeze(self) -> "Backbone":
        for p in self.parameters():
            p.requires_grad_(False)
        super().train(False)
        return self

    def train(self, mode: bool = True) -> "Backbone":  # the backbone stays in eval mode
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
        """The evaluation transform: PIL image -> normalised tensor."""
        import open_clip

        return open_clip.image_transform(self.image_size, is_train=False, mean=self.mean, std=self.std)

    # -- encoding ----------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(texts), context_length=self.model_context_length)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw image-tower outputs [B, D] (float32) for a batch of preprocessed images."""
        pixels = pixels.to(self.device, self.dtype)
        return self.model.encode_image(pixels).float()

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], batch_size: int = 1024) -> torch.Tensor:
        """Raw text-tower outputs [N, D] (float32)."""
        out = []
        for i in range(0, len(texts), batch_size):
            tokens = self.tokenize(texts[i : i + batch_size]).to(self.device)
            out.append(self.model.encode_text(tokens).float())
        return torch.cat(out)

    def describe(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "geometry": self.geometry.name,
            "geometry_params": self.geometry.params(),
            "weights_sha256": self.weights_sha256,
            "image_size": self.image_size,
            "tokenizer": self.tokenizer_spec,
            "local_attention": self.local_attention or None,
        }

    @property
    def variant(self) -> str:
        """A key for what changes the features besides the weights (empty for the plain backbone)."""
        import json

        return json.dumps(self.local_attention, sort_keys=True) if self.local_attention else ""


# ---------------------------------------------------------------------------
# Cards
# ---------------------------------------------------------------------------


def shipped_cards() -> Dict[str, Path]:
    """Cards shipped with fewclip: name -> path."""
    return {p.stem: p for p in sorted(REFERENCE_DIR.glob("*.yaml"))}


def read_card(path: str | Path) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise BackboneError(f"backbone card not found: {path}")
    try:
        card = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:
        raise BackboneError(f"cannot parse backbone card {path}: {e}") from None
    if not isinstance(card, dict):
        raise BackboneError(f"backbone card {path} must be a YAML mapping")
    allowed = {"name", "description", "architecture", "model_config", "model_config_file", "weights",
               "tokenizer", "geometry", "preprocess", "sha256", "trained_with", "final_ln"}
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
    card["_dir"] = str(path.resolve().parent)
    card["_path"] = str(path.resolve())
    return card


def _card_model_config(card: Dict[str, Any]) -> Dict[str, Any]:
    import json

    from open_clip.factory import get_model_config

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
    with open(p, encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg.get("model_cfg", cfg)


def remove_final_ln(model: nn.Module) -> nn.Module:
    """Drop the final LayerNorm of both towers (the EuCLIP recipe; card key ``final_ln: false``)."""
    model.visual.ln_post = nn.Identity()
    if hasattr(model, "ln_final"):
        model.ln_final = nn.Identity()
    else:
        model.text.ln_final = nn.Identity()
    return model


def build_open_clip_model(model_cfg: Dict[str, Any]) -> nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a model config dict (random init)."""
    from open_clip.model import CLIP, CustomTextCLIP

    cfg = dict(model_cfg)
    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in cfg.get("text_cfg", {})
    cls = CustomTextCLIP if custom_text else CLIP
    return cls(**cfg)


def _card_tokenizer(card: Dict[str, Any], model_cfg: Dict[str, Any]):
    spec = dict(card.get("tokenizer") or {"type": "open_clip"})
    kind = spec.get("type", "open_clip")
    ctx = model_cfg.get("text_cfg", {}).get("context_length", 77)
    if kind == "word":
        from .tokenizer import WordTokenizer

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
    if kind == "open_clip":
        import open_clip

        name = spec.get("name") or card.get("architecture")
        tok = open_clip.get_tokenizer(name) if name else open_clip.tokenizer.SimpleTokenizer(context_length=ctx)
        return tok, {"type": "open_clip", "name": name}
    raise BackboneError(f"card {card['_path']}: tokenizer type must be 'word' or 'open_clip', got {kind!r}")


def load_card(card_path: str | Path, cfg: BackboneConfig) -> Backbone:
    card = read_card(card_path)
    model_cfg = _card_model_config(card)
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
        model = build_open_clip_model(model_cfg)
    except Exception as e:
        raise BackboneError(f"card {card['_path']}: cannot build the model from its config: {e}") from None
    if card.get("final_ln", True) is False:
        remove_final_ln(model)
    load_state_dict_strict(model, load_weights_file(weights), str(weights))
    tokenizer, tok_spec = _card_tokenizer(card, model_cfg)
    gparams = dict(card["geometry"])
    gname = gparams.pop("name", None)
    if gname is None:
        raise BackboneError(f"card {card['_path']}: geometry needs a 'name'")
    try:
        geometry = make_geometry(gname, **gparams)
    except ValueError as e:
        raise BackboneError(f"card {card['_path']}: {e}") from None
    pre = card.get("preprocess") or {}
    image_size = model_cfg["vision_cfg"].get("image_size", 224)
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    bb = Backbone(
        model,
        tokenizer,
        geometry,
        name=card.get("name", Path(card_path).stem),
        image_size=image_size,
        mean=pre.get("mean", OPENAI_MEAN),
        std=pre.get("std", OPENAI_STD),
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
        override = "sigmoid" if bias is not None else "clip"
    params: Dict[str, float] = {"logit_scale": scale}
    if override == "sigmoid":
        params["logit_bias"] = float(bias.detach().float().reshape(-1)[0]) if bias is not None else -10.0
    try:
        return make_geometry(override, **params)
    except ValueError as e:
        raise BackboneError(f"backbone.geometry: {e}") from None


def load_open_clip(cfg: BackboneConfig) -> Backbone:
    import open_clip

    arch = cfg.name
    pretrained = cfg.pretrained
    if pretrained is None:
        tags = [t for m, t in open_clip.list_pretrained() if m == arch]
        raise BackboneError(
            f"backbone={arch} is an open_clip architecture: say which weights with backbone.pretrained=TAG "
            f"(known tags: {', '.join(tags) or 'none'}), a local checkpoint file, or none (random weights)"
        )
    weights_sha = None
    if pretrained.lower() == "none":
        model = open_clip.create_model(arch, pretrained=None)
        source = f"open_clip:{arch} (random init)"
    elif Path(pretrained).exists():
        p = Path(pretrained)
        model = open_clip.create_model(arch, pretrained=None)
        sd = load_weights_file(p)
        try:
            from open_clip.factory import convert_state_dict

            sd = convert_state_dict(model, sd)
        except Exception:  # conversion is best effort; the strict check below decides
            pass
        if "logit_scale" in sd and sd["logit_scale"].ndim != model.logit_scale.ndim:
            sd["logit_scale"] = sd["logit_scale"].reshape(model.logit_scale.shape)
        load_state_dict_strict(model, sd, str(p))
        weights_sha = sha256_file(p)
        source = f"open_clip:{arch} weights={p}"
    else:
        known = open_clip.list_pretrained_tags_by_model(arch)
        if pretrained not in known:
            raise BackboneError(
                f"backbone.pretrained={pretrained!r} is neither a local file nor a known open_clip tag for {arch} "
                f"(known: {', '.join(known) or 'none'})"
            )
        try:
            model = open_clip.create_model(arch, pretrained=pretrained, cache_dir=cfg.cache_dir, weights_only=True)
        except Exception as e:
            raise BackboneError(
                f"could not load open_clip weights {arch}/{pretrained}: {e}. Without network access, download the "
                f"checkpoint elsewhere and pass its path: backbone.pretrained=/path/to/open_clip_model.safetensors"
            ) from None
        source = f"open_clip:{arch}/{pretrained}"
    pre = getattr(model.visual, "preprocess_cfg", {}) or {}
    image_size = getattr(model.visual, "image_size", 224)
    if isinstance(image_size, (list, tuple)):
        image_size = image_size[0]
    bb = Backbone(
        model,
        open_clip.get_tokenizer(arch),
        _geometry_for_open_clip(model, cfg.geometry),
        name=arch if pretrained.lower() == "none" else f"{arch}/{Path(pretrained).name}",
        image_size=image_size,
        mean=pre.get("mean", OPENAI_MEAN),
        std=pre.get("std", OPENAI_STD),
        weights_sha256=weights_sha,
        source=source,
        tokenizer_spec={"type": "open_clip", "name": arch},
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
    """Resolve ``cfg.name`` (card path, shipped card, open_clip architecture) and load it frozen."""
    name = cfg.name
    if name.endswith((".yaml", ".yml")):
        if cfg.pretrained not in (None,):
            raise BackboneError("backbone.pretrained applies to open_clip architectures; a card names its own weights")
        return load_card(name, cfg)
    cards = shipped_cards()
    if name in cards:
        return load_card(cards[name], cfg)
    import open_clip

    if name in open_clip.list_models():
        return load_open_clip(cfg)
    raise BackboneError(
        f"unknown backbone {name!r}: not a card file, not a shipped card ({', '.join(cards) or 'none shipped'}), "
        f"and not an open_clip architecture. `fewclip backbones` lists what can be loaded."
    )


def list_backbones() -> List[Dict[str, str]]:
    """What can be loaded: shipped cards with their geometry, then open_clip architectures and tags."""
    import open_clip

    rows = []
    for name, path in shipped_cards().items():
        try:
            card = read_card(path)
            rows.append({"name": name, "kind": "card", "geometry": str(card["geometry"].get("name")),
                         "weights": card["weights"], "description": card.get("description", "")})
        except BackboneError as e:
            rows.append({"name": name, "kind": "card", "geometry": "?", "weights": "", "description": f"broken: {e}"})
    tags: Dict[str, List[str]] = {}
    for arch, tag in open_clip.list_pretrained():
        tags.setdefault(arch, []).append(tag)
    for arch in open_clip.list_models():
        cfg = open_clip.factory.get_model_config(arch) or {}
        geom = "sigmoid" if cfg.get("init_logit_bias") is not None else "clip"
        rows.append({"name": arch, "kind": "open_clip", "geometry": geom,
                     "weights": ", ".join(tags.get(arch, [])) or "none", "description": ""})
    return rows
