"""``fewclip COMMAND --help`` for the commands with a run config (train, zeroshot, sweep, features), without
importing torch or a method: the config sections are torch-free dataclasses (``fewclip.config.sections``,
``fewclip.config.compose``, ``fewclip.config.sweep``), and a built-in method's section comes from the adapter index
(``fewclip.adapter.index``). Where that is not enough (a plugin's method or launcher, an index made from other
sources) :func:`help_lines` returns None and the command's full help imports what it needs."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import field, make_dataclass
from typing import Any, Optional

from fewclip.adapter.index import load_index
from fewclip.config.compose import (
    FeaturesConfig,
    RunConfig,
    TrainRunFields,
    compose,
    find_yaml,
    load_yaml,
    section_name_of,
    split_args,
    to_object,
    train_base,
)
from fewclip.config.help import describe_config
from fewclip.config.presets import FEWCLIP, preset_name_of
from fewclip.config.sections import LAUNCHER_SECTIONS, AdapterConfig
from fewclip.config.sweep import compose_sweep_config

HEADER = "fewclip {command} options (key=value; defaults shown, `# ...` says what each does):\n"
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "Any": Any}
_GENERIC = re.compile(r"(Optional|List|list)\[(.+)\]")


def _type(text: str):
    """A field annotation of the index (``int``, ``Optional[str]``, ``List[float]``, ``list[float]``) as a type, or None."""
    text = text.strip()
    if text in _TYPES:
        return _TYPES[text]
    m = _GENERIC.fullmatch(text)
    inner = _type(m.group(2)) if m else None
    if inner is None:
        return None
    return Optional[inner] if m.group(1) == "Optional" else list[inner]


def method_section(entry: dict[str, Any]) -> Optional[AdapterConfig]:
    """A stand-in for the method's config dataclass: the same fields, types, defaults and help."""
    specs = []
    for f in entry["fields"]:
        typ = _type(f["type"])
        if typ is None:
            return None
        value = f["default"]
        meta = {"help": f["help"]} if f["help"] else None
        default = (field(default_factory=lambda v=value: list(v), metadata=meta) if isinstance(value, list)
                   else field(default=value, metadata=meta))
        specs.append((f["name"], typ, default))
    return make_dataclass(entry["config"], specs, bases=(AdapterConfig,))()


def _train(args: Sequence[str]):
    methods = load_index()
    entry = (methods or {}).get(section_name_of(args, "adapter", "coop"))
    section = method_section(entry) if entry is not None else None
    yamls, dotlist = split_args(args)
    if section is None or preset_name_of(dotlist, [load_yaml(find_yaml(y)) for y in yamls]) != FEWCLIP:
        return None  # a preset's values are registered with its method
    return to_object(compose(TrainRunFields, args, base=train_base(TrainRunFields, section, entry["train_defaults"],
                                                                   entry["trains"])))


def _sweep(args: Sequence[str]):
    launcher = LAUNCHER_SECTIONS.get(section_name_of(args, "launcher", "local"))
    return compose_sweep_config(args, launcher) if launcher is not None else None


CONFIGS = {"zeroshot": lambda args: RunConfig(), "features": lambda args: FeaturesConfig(), "train": _train,
           "sweep": _sweep}


def help_lines(command: str, args: Sequence[str]) -> Optional[list[str]]:
    """The help of ``fewclip COMMAND ARGS --help`` (the config those arguments give, each option with its help),
    or None when it needs the methods or launchers imported."""
    config = CONFIGS[command]([a for a in args if a not in ("--help", "-h")])
    if config is None:
        return None
    return [HEADER.format(command=command), *describe_config(config)]
