"""Checkpoint formats: ``fewclip import FORMAT CHECKPOINT out=DIR [key=value ...]``.

Each format reads the files that one group of authors publishes, in their own layout
(wrapping dicts, key names, parameters stored as logs, their clamps), and returns an
``Imported``: the weights in the layout of a fewclip card model and the card's
sections (architecture, geometry with every parameter, tokenizer, preprocessing).
``import_checkpoint`` writes the card folder (``card.yaml``, ``weights.safetensors``,
a Hugging Face tokenizer folder where the model uses one) and loads it back before
it reports success, so ``backbone=DIR`` works in every command.

A fact that a checkpoint does not carry (the EuCLIP geometry, a training flag; the
head count of MERU's timm ViT, which no tensor shape shows) is an option the format
requires by name; nothing is guessed.

A format is one module with one ``register_format(Format(...))`` call, like an
adapter; this file imports each explicitly.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from fewclip.backbones.backbone import CARD_FILE, BackboneConfig, BackboneError, load_backbone, sha256_file
from fewclip.utils.io import _umask, atomic_write_text, os_error_of
from fewclip.utils.logs import quiet
from fewclip.utils.registry import Registry


class CheckpointImportError(BackboneError):
    """A checkpoint that cannot be imported as given; the message says what to add or change."""


@dataclass
class Imported:
    """What a format read: weights in the card model's layout and the card's sections."""

    weights: dict[str, torch.Tensor]
    # architecture | model_config (+ image_tower), final_ln, tokenizer, geometry, preprocess
    card: dict[str, Any]
    # What was read or decided (stored parameters, clamps applied, defaults taken from the authors' code).
    notes: list[str] = field(default_factory=list)
    # A Hugging Face tokenizer to save into the card folder (an open_clip HFTokenizer's .tokenizer).
    hf_tokenizer: Any = None


@dataclass(frozen=True)
class Format:
    name: str
    # read(checkpoint path, options) -> Imported
    read: Callable[[Path, dict[str, str]], Imported]
    # option -> what it means; "prefix.*" accepts any key under the prefix
    options: dict[str, str]
    required: tuple[str, ...] = ()
    # One line: whose files, what is read from them.
    summary: str = ""


# Built-in formats are the modules of ``fewclip.formats``; a package adds one through the entry point group
# ``fewclip.formats`` (fewclip.utils.registry).
FORMATS: Registry[Format] = Registry("checkpoint format", "fewclip.formats", listing="fewclip import")


def register_format(fmt: Format) -> Format:
    return FORMATS.register(fmt.name, fmt, source=getattr(fmt.read, "__module__", None))


COMMON_OPTIONS = {
    "out": "the card folder to write (required; must not hold a card yet)",
    "name": "the card's name (default: the folder's name)",
}


def _allowed(fmt: Format, key: str) -> bool:
    if key in fmt.options or key in COMMON_OPTIONS:
        return True
    return any(o.endswith(".*") and key.startswith(o[:-1]) for o in fmt.options)


def format_usage(fmt: Format) -> str:
    opts = {**fmt.options, **COMMON_OPTIONS}
    lines = [f"{fmt.name}: {fmt.summary}"]
    for k, v in opts.items():
        need = " (required)" if k in fmt.required else ""
        lines.append(f"    {k.replace('.*', '.KEY')}=VALUE{need}  {v}")
    return "\n".join(lines)


def formats_usage() -> str:
    return "\n".join(format_usage(FORMATS[n]) for n in sorted(FORMATS))


def import_checkpoint(fmt_name: str, checkpoint: str | Path, out: str | Path,
                      options: Optional[dict[str, str]] = None, name: Optional[str] = None) -> tuple[Path, Any]:
    """Read ``checkpoint`` as ``fmt_name`` and write the card folder ``out``; returns (card path, backbone)."""

    if fmt_name not in FORMATS:
        raise CheckpointImportError(FORMATS.unknown(fmt_name))
    fmt = FORMATS[fmt_name]
    options = dict(options or {})
    bad = sorted(k for k in options if not _allowed(fmt, k) or k in COMMON_OPTIONS)
    if bad:
        raise CheckpointImportError(f"format {fmt.name} does not take {bad}.\n{format_usage(fmt)}")
    missing = [k for k in fmt.required if k not in options]
    if missing:
        raise CheckpointImportError(f"format {fmt.name} needs {', '.join(f'{k}=' for k in missing)}: "
                           + "; ".join(f"{k}: {fmt.options[k]}" for k in missing))
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_file():
        raise CheckpointImportError(f"checkpoint not found: {checkpoint}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointImportError(f"out={out} exists and is not an empty folder; choose a new folder for the card")
    imported = fmt.read(checkpoint, options)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights = {k: v.detach().cpu().contiguous().clone() for k, v in imported.weights.items()}
        try:
            save_file(weights, str(tmp / "weights.safetensors"))
        except Exception as e:  # safetensors' own error type for a failed write (a full disk): the OSError it is
            raise os_error_of(e, out / "weights.safetensors") or e
        card: dict[str, Any] = {"name": name or out.name, **imported.card}
        if imported.hf_tokenizer is not None:
            imported.hf_tokenizer.save_pretrained(str(tmp / "tokenizer"))
            card["tokenizer"] = {**card["tokenizer"], "path": "tokenizer"}
        card["weights"] = "weights.safetensors"
        card["sha256"] = sha256_file(tmp / "weights.safetensors")
        card["imported_from"] = {"format": fmt.name, "checkpoint": str(checkpoint.resolve()),
                                 "checkpoint_sha256": sha256_file(checkpoint), "options": options,
                                 "notes": imported.notes}
        atomic_write_text(tmp / CARD_FILE, OmegaConf.to_yaml(OmegaConf.create(card)))
        # Load it back: a card that does not load is never left behind as if it were fine.
        with quiet("fewclip.backbones.backbone"):  # its "loaded" line would name the temporary folder; the summary says it
            backbone = load_backbone(BackboneConfig(name=str(tmp), device="cpu"))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a card folder is an ordinary folder
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BackboneError as e:  # the card did not load back: say so about the user's file, not the temporary folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise type(e)(name_users_file(str(e), tmp, checkpoint, fmt.name)) from None
    except OSError as e:  # (a full disk): about the card folder the user asked for, not the temporary one
        shutil.rmtree(tmp, ignore_errors=True)
        name = str(e.filename or "")
        if name.startswith(str(tmp)):
            raise OSError(e.errno, e.strerror, str(out) + name[len(str(tmp)):]) from e
        raise
    except BaseException:  # Ctrl-C included: no half-written card folder is left; the error goes on unchanged
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    backbone.source = str(out)
    return out / CARD_FILE, backbone


def name_users_file(message: str, tmp: Path, checkpoint: Path, fmt: str) -> str:
    """``message`` (about the card folder being written in ``tmp``, deleted by now) about ``checkpoint`` instead."""
    for folder in sorted({str(tmp.resolve()), str(tmp.absolute()), str(tmp)}, key=len, reverse=True):
        message = message.replace(f"{folder}{os.sep}weights.safetensors", f"{checkpoint} (imported as {fmt})")
        message = message.replace(f"card {folder}{os.sep}{CARD_FILE}", f"the card imported from {checkpoint}")
        message = message.replace(folder, f"the card imported from {checkpoint}")
    return message


def parse_import_args(args: Sequence[str]) -> tuple[str, str, str, Optional[str], dict[str, str]]:
    """``FORMAT CHECKPOINT out=DIR [name=NAME] [key=value ...]`` -> (format, checkpoint, out, name, options)."""
    positional = [a for a in args if "=" not in a]
    pairs = [a.split("=", 1) for a in args if "=" in a]
    usage = ("usage: fewclip import FORMAT CHECKPOINT out=DIR [key=value ...]; "
             f"formats: {', '.join(sorted(FORMATS))} (`fewclip import` alone lists each one's options)")
    if len(positional) != 2:
        raise CheckpointImportError(usage)
    options = dict(pairs)
    if len(options) != len(pairs):
        raise CheckpointImportError(f"an option is given twice in {args}")
    out = options.pop("out", None)
    if not out:
        raise CheckpointImportError(f"out=DIR is required (the card folder to write); {usage}")
    name = options.pop("name", None)
    return positional[0], positional[1], out, name, options


def import_from_args(args: Sequence[str]) -> str:
    """Run ``fewclip import`` on command-line arguments; returns the summary to print."""
    fmt, ckpt, out, name, options = parse_import_args(args)
    card_path, bb = import_checkpoint(fmt, ckpt, out, options, name=name)
    g = bb.geometry.params()
    lines = [f"imported {fmt} checkpoint {ckpt} -> {card_path}",
             f"  geometry {bb.geometry.name}: " + ", ".join(f"{k}={v:.6g}" for k, v in g.items()),
             f"  images: {bb.preprocess_cfg.describe()}", f"  tokenizer {bb.tokenizer_spec}"]

    card = OmegaConf.to_container(OmegaConf.load(card_path))
    lines += [f"  {n}" for n in card["imported_from"]["notes"]]
    lines.append(f"use it with backbone={Path(out)}")
    return "\n".join(lines)


