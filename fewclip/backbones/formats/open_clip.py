"""open_clip checkpoints: a bare state dict, or open_clip_train's ``{"epoch", "name", "state_dict", ...}``.

open_clip_train saves the DistributedDataParallel state dict (``module.`` prefixes) under
``state_dict`` with the epoch, the run name and the optimizer; the model's name is not
in the file, so ``model=`` (an open_clip architecture) or ``model_config=`` (its JSON) is
required. The geometry is open_clip's: cosine, or sigmoid where the weights hold a
``logit_bias`` (SigLIP), with the logit scale (stored as its log) and bias read from the
weights. A model that names a Hugging Face tokenizer gets it from ``tokenizer=DIR`` or the
local Hugging Face cache, saved into the card folder.

The helpers here are shared with the EuCLIP format (the paper's open_clip fork).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
from open_clip.factory import get_model_config

from fewclip.backbones.backbone import (
    EUCLIP_GEOMETRY_KEYS,
    OPENAI_EXTRA_KEYS,
    BackboneError,
    known_weights_error,
    model_tokenizer,
    read_checkpoint,
)
from fewclip.backbones.fingerprints import identify
from fewclip.backbones.importer import CheckpointImportError, Format, Imported, register_format
from fewclip.backbones.preprocess import (
    PREPROCESS_OPTIONS,
    PreprocessConfig,
    PreprocessError,
    options_given,
    parse_preprocess_options,
    published_preprocess,
)


def open_clip_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of an open_clip checkpoint: bare, or open_clip_train's wrapper, ``module.`` stripped."""
    ck = read_checkpoint(path)
    sd = ck["state_dict"] if isinstance(ck, dict) and isinstance(ck.get("state_dict"), dict) else ck
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        keys = list(ck)[:6] if isinstance(ck, dict) else type(ck).__name__
        raise CheckpointImportError(f"{path} does not hold an open_clip state dict (bare, or under 'state_dict' as "
                                    f"open_clip_train saves it); found {keys}")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return dict(sd)


def _translate_final_layernorm(cfg: dict[str, Any], where: str) -> tuple[dict[str, Any], bool]:
    """The EuCLIP fork's ``final_layernorm`` keys (vision_cfg, text_cfg) -> the card's ``final_ln``."""
    cfg = {**cfg, "vision_cfg": dict(cfg.get("vision_cfg", {})), "text_cfg": dict(cfg.get("text_cfg", {}))}
    flags = {t: cfg[f"{t}_cfg"].pop("final_layernorm", True) for t in ("vision", "text")}
    if flags["vision"] != flags["text"]:
        raise CheckpointImportError(f"{where}: final_layernorm is {flags['vision']} for the image tower and "
                                    f"{flags['text']} for the text tower; fewclip's final_ln applies to both")
    return cfg, bool(flags["vision"])


def resolve_model(options: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any], bool, list[str]]:
    """(card architecture entry, model config, final_ln, notes) from ``model=`` or ``model_config=``.

    ``model=`` is an open_clip architecture, or one of the EuCLIP fork's ``ARCH-no-final-ln``
    configs (ARCH without the final LayerNorms); ``model_config=`` a model-config JSON, the
    fork's ``final_layernorm`` keys included.
    """

    if ("model" in options) == ("model_config" in options):
        raise CheckpointImportError("give the architecture the checkpoint was trained with: model=ARCH (an open_clip "
                                    "name, as passed to --model) or model_config=FILE.json (its model config)")
    if "model_config" in options:
        p = Path(options["model_config"])
        if not p.is_file():
            raise CheckpointImportError(f"model_config file not found: {p}")
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:  # not JSON, or not text (UnicodeDecodeError is a ValueError)
            raise CheckpointImportError(f"model_config={p} is not a JSON model config ({_why(e)}); give the "
                                        f"open_clip model-config JSON the checkpoint was trained with") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("model_cfg", raw), dict):
            raise CheckpointImportError(f"model_config={p} holds {type(raw).__name__} JSON, not a model config "
                                        f"(an object with embed_dim, vision_cfg and text_cfg)")
        cfg, final_ln = _translate_final_layernorm(raw.get("model_cfg", raw), str(p))
        return {"model_config": cfg}, cfg, final_ln, [f"architecture: model config {p}"]
    name = options["model"]
    cfg = get_model_config(name)
    if cfg is not None:
        cfg, final_ln = _translate_final_layernorm(cfg, name)
        return {"architecture": name}, cfg, final_ln, [f"architecture: open_clip {name}"]
    base = name[: -len("-no-final-ln")] if name.endswith("-no-final-ln") else None
    if base and get_model_config(base) is not None:
        cfg, _ = _translate_final_layernorm(get_model_config(base), base)
        return ({"architecture": base}, cfg, False,
                [f"architecture: {name} = open_clip {base} without the final LayerNorms (the EuCLIP fork's config)"])
    raise CheckpointImportError(f"model={name} is not an open_clip architecture (`fewclip backbones --all` lists "
                                f"them); for a config of your own give model_config=FILE.json")


def _why(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"line {e.lineno} column {e.colno}: {e.msg}"
    return "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)


def check_final_ln(sd: dict[str, torch.Tensor], final_ln: bool, model_name: Optional[str], path: Path, fmt: str):
    """A file with (without) the text tower's final LayerNorm under an architecture without (with) one is an error
    naming the architecture it fits (the EuCLIP fork's ``ARCH-no-final-ln`` configs drop both towers' final LN)."""
    has_ln = any(k in sd for k in ("ln_final.weight", "text.ln_final.weight"))
    if has_ln == final_ln:
        return
    name = model_name or "ARCH"
    if final_ln:  # the file lacks them
        base = name[: -len("-no-final-ln")] if name.endswith("-no-final-ln") else name
        raise CheckpointImportError(
            f"{path} has no final LayerNorms (no ln_final / visual.ln_post): it was trained with the EuCLIP fork's "
            f"{base}-no-final-ln, not {name}. Import it: fewclip import euclip {path} model={base}-no-final-ln "
            f"geometry=... out=DIR (or a model_config with \"final_layernorm\": false)")
    base = name[: -len("-no-final-ln")] if name.endswith("-no-final-ln") else name
    raise CheckpointImportError(
        f"{path} has final LayerNorms (ln_final, visual.ln_post), which {name} lacks: it was trained with {base}; "
        f"use model={base}" + (" (or `fewclip import open_clip`)" if fmt == "euclip" else ""))


def check_open_clip_keys(sd: dict[str, torch.Tensor], model_cfg: dict[str, Any], path: Path, fmt: str,
                         model_name: Optional[str] = None):
    """Refuse the layouts of other formats and weights whose fingerprint names another activation; drop OpenAI's
    extra keys under a QuickGELU config."""
    if fmt == "open_clip" and any(k in sd for k in EUCLIP_GEOMETRY_KEYS):
        raise CheckpointImportError(
            f"{path} holds EuCLIP's hyperbolic parameters ({', '.join(EUCLIP_GEOMETRY_KEYS)}): import it with "
            f"`fewclip import euclip {path} model=... geometry=...`")
    refusal = known_weights_error(identify(sd), model_name or "this model config", path,
                                  bool(model_cfg.get("quick_gelu", False)))
    if refusal:
        raise CheckpointImportError(refusal.replace("Use backbone=", "Import it with model="))
    if any(k in sd for k in OPENAI_EXTRA_KEYS):
        if not model_cfg.get("quick_gelu", False):
            raise CheckpointImportError(
                f"{path} is an OpenAI CLIP checkpoint (it carries {', '.join(OPENAI_EXTRA_KEYS)}), whose towers use "
                f"QuickGELU; this model config uses GELU. Import it with `fewclip import openai {path} out=DIR`, or "
                f"name the -quickgelu architecture")
        sd = {k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS}
    return sd


def read_tokenizer(model_cfg: dict[str, Any], arch: Optional[str], options: dict[str, str], where: str):
    """(card tokenizer section, HF tokenizer to save or None, note) for an open_clip model config."""
    try:
        tok, spec = model_tokenizer(model_cfg, arch, options.get("tokenizer"), where)
    except BackboneError as e:
        raise CheckpointImportError(str(e).replace("backbone.tokenizer=", "tokenizer=")) from None
    if spec["type"] == "hf":
        return {"type": "hf", "name": spec["name"]}, tok.hf, f"tokenizer: Hugging Face {spec['name']}, saved here"
    return {"type": "open_clip", **({"name": arch} if arch else {})}, None, "tokenizer: open_clip's CLIP BPE"


def image_size_of(model_cfg: dict[str, Any]) -> int:
    size = (model_cfg.get("vision_cfg") or {}).get("image_size", 224)
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def preprocess(model_cfg: dict[str, Any], options: dict[str, str], arch: Optional[str],
               tags: bool = True) -> tuple[PreprocessConfig, str]:
    """The image preprocessing of an open_clip(-trained) checkpoint.

    ``pretrained=TAG``: the file holds that open_clip tag's weights, preprocessed as open_clip's pretrained
    configuration of the tag says. Otherwise open_clip_train's default (the model config's ``preprocess_cfg``,
    else open_clip's defaults: shorter side, bicubic, OpenAI's mean/std) with the options given
    (``resize_mode=``, ``interpolation=``, ``mean=``, ``std=``, ``fill_color=``). Where a published tag of the
    architecture is preprocessed otherwise in a field not given (SigLIP's squash and 0.5), a file of those
    weights and a checkpoint trained from scratch cannot be told apart: that is an error asking which.
    ``tags``: whether the format takes ``pretrained=TAG`` (EuCLIP's checkpoints are no open_clip tag).
    """
    size = image_size_of(model_cfg)
    given = list(options_given(options))
    try:
        if "pretrained" in options:
            tag = options["pretrained"]
            if arch is None:
                raise CheckpointImportError("pretrained=TAG names an open_clip tag of model=ARCH; give model=, not "
                                            "model_config=")
            tags = published_preprocess(arch, size)
            if tag not in tags:
                raise CheckpointImportError(f"pretrained={tag} is not a published open_clip tag of {arch} (known: "
                                            f"{', '.join(tags) or 'none'})")
            if given:
                raise CheckpointImportError(f"pretrained={tag} gives the preprocessing of those weights; drop "
                                            f"{', '.join(f'{k}=' for k in given)}")
            return tags[tag], f"preprocessing: open_clip's {arch}/{tag}: {tags[tag].describe()}"
        base = PreprocessConfig.from_mapping(
            {k: v for k, v in (model_cfg.get("preprocess_cfg") or {}).items() if k != "size"}, size,
            "the model config's preprocess_cfg")
        cfg = parse_preprocess_options(options, size, base)
    except PreprocessError as e:
        raise CheckpointImportError(str(e)) from None
    if arch:
        unsaid = {tag: [d for d in cfg.differences(other) if d.split(" ")[0] not in given]
                  for tag, other in published_preprocess(arch, size).items()}
        unsaid = {tag: d for tag, d in unsaid.items() if d}
        if unsaid:
            shown = "; ".join(f"{tag}: {', '.join(d)}" for tag, d in sorted(unsaid.items())[:6])
            more = f" (and {len(unsaid) - 6} more tags)" if len(unsaid) > 6 else ""
            raise CheckpointImportError(
                f"open_clip's published weights for {arch} are preprocessed otherwise ({shown}{more}) than "
                f"{'the options given' if given else 'its default'} ({cfg.describe()}), and the file does not say "
                f"which it holds: give " + ("pretrained=TAG (the tag these weights are), or, for weights of your own, "
                                            if tags else "") +
                "every field that differs (resize_mode=, interpolation=, mean=R,G,B, std=R,G,B)")
    how = "as given" if given else "the model config's / open_clip_train's default"
    return cfg, f"preprocessing: {cfg.describe()} ({how})"


def read_open_clip(path: Path, options: dict[str, str]) -> Imported:
    return open_clip_card(open_clip_state_dict(path), path, options)


def open_clip_card(sd: dict[str, torch.Tensor], path: Path, options: dict[str, str],
                   fmt: str = "open_clip") -> Imported:
    """The card of an open_clip state dict ``sd`` read from ``path`` (by this format, or by a plugin's format for
    another file layout of the same tensors, named ``fmt``)."""
    arch_entry, model_cfg, final_ln, notes = resolve_model(options)
    if not final_ln:
        raise CheckpointImportError("a model without final LayerNorms is EuCLIP's recipe: import it with "
                                    "`fewclip import euclip ... geometry=...`")
    arch = arch_entry.get("architecture")
    tok_card, hf_tok, tok_note = read_tokenizer(model_cfg, arch, options, f"model {arch or options.get('model_config')}")
    sd = check_open_clip_keys(sd, model_cfg, path, fmt, options.get("model"))
    check_final_ln(sd, final_ln, options.get("model"), path, fmt)
    pre, pre_note = preprocess(model_cfg, options, arch)
    scale = math.exp(float(sd["logit_scale"].float().reshape(-1)[0]))
    if "logit_bias" in sd:
        geometry = {"name": "sigmoid", "logit_scale": scale, "logit_bias": float(sd["logit_bias"].float().reshape(-1)[0])}
    else:
        geometry = {"name": "clip", "logit_scale": scale}
    notes += [f"geometry: {geometry['name']}, logit scale (and bias) from the weights", tok_note, pre_note]
    card = {"description": f"imported from {path.name} ({fmt})", **arch_entry, "tokenizer": tok_card,
            "geometry": geometry, "preprocess": pre.card_section()}
    return Imported(weights=sd, card=card, notes=notes, hf_tokenizer=hf_tok)


register_format(Format(
    name="open_clip",
    read=read_open_clip,
    options={
        "model": "the open_clip architecture it was trained as (--model), e.g. ViT-B-32 or ViT-B-16-SigLIP",
        "model_config": "instead of model=: the model-config JSON it was trained with",
        "tokenizer": "a folder holding the Hugging Face tokenizer the model names (SigLIP, ...), if not in the cache",
        "pretrained": "the open_clip tag these weights are (e.g. webli): their preprocessing, from open_clip",
        **PREPROCESS_OPTIONS,
    },
    summary="open_clip files: bare state dicts or open_clip_train checkpoints ({'state_dict': ...}, module. keys)",
))
