"""A mistyped command answered before torch is imported (a second of CPU, not the ten that importing torch and
open_clip take): ``fewclip train``, ``zeroshot``, ``sweep`` and ``features`` compose their config from the
torch-free dataclasses first (``fewclip.cli.quickhelp``: an unknown key or a wrong type fails here, naming the key)
and check the backbone names against the shipped cards and open_clip's architectures (read from open_clip's
config folder, without importing it), with the close matches. Anything this cannot decide (a plugin's method, a
preset) is left to the full command, which checks everything again."""
from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from fewclip.backbones.names import backbone_hint  # noqa: F401  (re-exported)
from fewclip.config.compose import ConfigError
from fewclip.runs.records import check_no_file_in_the_way
from fewclip.utils.errors import InputError

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference"  # fewclip.backbones.backbone.REFERENCE_DIR


class UnknownBackboneError(InputError):
    """A backbone name that is no card, shipped card or open_clip architecture."""


def shipped_card_names() -> list[str]:
    return sorted(p.stem for p in REFERENCE_DIR.glob("*.yaml"))


def open_clip_architectures() -> list[str]:
    """open_clip's architecture names, from its model config files (without importing open_clip and torch)."""
    spec = importlib.util.find_spec("open_clip")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return sorted(p.stem for f in folders for p in (Path(f) / "model_configs").glob("*.json"))


def is_card_path(name: str) -> bool:  # fewclip.backbones.backbone.is_card_path
    return name.endswith((".yaml", ".yml")) or Path(name).is_dir()


def check_backbone(name: str, key: str = "backbone") -> None:
    """Refuse a backbone name that cannot be loaded, with the close matches (a path is checked when loaded)."""
    if not isinstance(name, str) or is_card_path(name):
        return
    cards, archs = shipped_card_names(), open_clip_architectures()
    if "open_clip" in sys.modules:  # loaded in this process: architectures added at run time count too
        archs = sorted(set(archs) | set(sys.modules["open_clip"].list_models()))
    if name in cards or name in archs or not archs:  # no open_clip config folder found: the full check decides
        return
    raise UnknownBackboneError(
        f"unknown backbone {name!r} ({key}); {backbone_hint(name, cards, archs)}the shipped cards are "
        f"{', '.join(cards)}, and open_clip has {len(archs)} architectures: `fewclip backbones` lists them "
        f"(a card file or folder is also a backbone)")


def check_adapter(args: Sequence[str]) -> None:
    """Refuse a method name that is not one of fewclip's own (from the adapter index), where no plugin adds
    methods (a plugin's names are known only once it is imported: the full command checks those)."""

    from fewclip.adapter.index import load_index
    from fewclip.config.compose import section_name_of
    from fewclip.utils.registry import UnknownNameError, plugin_entry_points

    if "fewclip.adapter.base" in sys.modules:  # the registry is live in this process (a method registered in Python)
        return
    name = section_name_of(args, "adapter", "coop")
    index = load_index()
    if not index or name in index:
        return
    if plugin_entry_points("fewclip.adapters"):
        return
    close = difflib.get_close_matches(name, list(index), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise UnknownNameError(f"unknown adapter {name!r} (adapter.name); {hint}registered: {', '.join(sorted(index))} "
                           f"(`fewclip adapters` describes them)")


def config_of(command: str, args: Sequence[str]) -> Optional[object]:
    """The command's config composed without torch, or None where that needs the methods imported. A bad key or
    type raises ConfigError; other doubts (a value a check in the full config may accept) give None."""
    from fewclip.cli.quickhelp import CONFIGS

    make = CONFIGS.get(command)
    if make is None:
        return None
    try:
        return make(list(args)) if command in ("train", "sweep") else _compose_run(command, args)
    except ConfigError:
        raise
    except Exception:  # e.g. a registry the torch-free path does not read: the full command says it
        return None


def _compose_run(command: str, args: Sequence[str]):
    from fewclip.config.compose import FeaturesConfig, RunConfig, load_config

    return load_config(list(args), FeaturesConfig if command == "features" else RunConfig)


def check(command: str, args: Sequence[str]) -> None:
    """Raise the first input error the command's arguments hold that can be found without torch."""
    if any(a.replace(" ", "") == "train.select=test" for a in args):
        return  # the full command refuses it naming what the method's authors did (their presets load with it)
    if command == "train":
        check_adapter(args)
    cfg = config_of(command, args)
    if cfg is None:
        return
    out = getattr(cfg, "out", None)
    if command != "features" and isinstance(out, str) and out:  # features' out is a file; the others' a folder
        check_no_file_in_the_way(out, "out")
    sweep = getattr(cfg, "sweep", None)
    if sweep is not None and getattr(sweep, "backbones", None):
        for name in sweep.backbones:
            check_backbone(name, "sweep.backbones")
        return
    backbone = getattr(cfg, "backbone", None)
    if backbone is not None:
        check_backbone(getattr(backbone, "name", None), "backbone")
