"""Named presets of a method's settings: the authors' procedure, the paper's, and fewclip's own default.

fewclip's defaults differ from the authors' code where the code is questionable (a tie broken by grid
order, a gradient never zeroed); a user must be able to run either and see the difference without reading
the code. A preset is data: the ``adapter.*`` and ``train.*`` fields it sets, each with its source (the
authors' file and line, or the paper's section) and a one-line reason, registered beside the method::

    register_presets("tip_adapter", Preset("authors", "Tip-Adapter's released code", settings=(
        Setting("adapter.tie_break", "first", "gaopengcuhk/Tip-Adapter@d0e2d6f utils.py:121",
                "their search keeps the first grid point of the best accuracy (strict >)"),)),
        on_test="...")

``fewclip train adapter=tip_adapter preset=authors`` applies the preset's values on top of the method's
defaults and *under* everything else the user gives: an explicit ``adapter.tie_break=loss`` (on the command
line or in a YAML piece) wins over the preset. ``preset=fewclip`` (or no preset) is fewclip's own default.

What a preset cannot say in fields (the authors' data pipeline, a per-dataset value) it lists in
``not_expressed``, so the difference is visible all the same. Choosing anything on the test set is never a
preset: ``train.select=test`` is refused, with a line naming what the authors did where they did
(``on_test``). A plugin registers its presets the same way (``fewclip.config.presets.register_presets``).

This module imports no torch: ``fewclip adapters NAME`` and the config loader read it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from fewclip.utils.errors import InputError
from fewclip.utils.registry import Registry

FEWCLIP = "fewclip"  # the name of the default (no preset): fewclip's own settings
SECTIONS = ("adapter", "train")  # the config sections a preset may set


class PresetError(InputError):
    """An unknown preset, or a choice on the test set that fewclip refuses; the message says what to use."""


@dataclass(frozen=True)
class Setting:
    """One field a preset sets: ``key`` ("adapter.tie_break", "train.lr"), its value, where the value comes from
    (``source``: repository@commit file:line, or the paper's section) and why it differs from fewclip's."""

    key: str
    value: Any
    source: str
    reason: str

    def __post_init__(self) -> None:
        section, _, leaf = self.key.partition(".")
        if section not in SECTIONS or not leaf or "." in leaf:
            raise ValueError(f"a preset sets adapter.FIELD or train.FIELD, got {self.key!r}")
        if not self.source or not self.reason:
            raise ValueError(f"preset setting {self.key}: give its source and a one-line reason")


@dataclass(frozen=True)
class Preset:
    """A named set of ``settings``; ``summary`` says whose procedure it is (one line), ``not_expressed`` lists
    differences that no field of the config can express (one line each, with the source)."""

    name: str
    summary: str
    settings: tuple[Setting, ...] = ()
    not_expressed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or not self.name.replace("_", "").isalnum():
            raise ValueError(f"a preset name is lowercase letters, digits and _, got {self.name!r}")
        keys = [s.key for s in self.settings]
        if len(set(keys)) != len(keys):
            raise ValueError(f"preset {self.name!r} sets a field twice: {keys}")

    def values(self) -> dict[str, Any]:
        """``{key: value}`` of its settings."""
        return {s.key: s.value for s in self.settings}


@dataclass(frozen=True)
class MethodPresets:
    """The presets of one method (``adapter``) and, where its authors choose on the test set, what they do."""

    adapter: str
    presets: tuple[Preset, ...]
    on_test: str = ""


DEFAULT = Preset(FEWCLIP, "fewclip's own defaults (the method's config and train defaults)")

# Presets by method name, filled by the methods' modules (the same entry points as the adapters).
PRESETS: Registry[MethodPresets] = Registry("preset table", "fewclip.adapters", key="preset",
                                            listing="fewclip adapters NAME")


def register_presets(adapter: str, *presets: Preset, on_test: str = "") -> MethodPresets:
    """Register the presets of method ``adapter`` (next to its ``register_adapter``). ``on_test``: one line
    saying what the authors choose on the test set, with the source (refused, never a preset)."""
    names = [p.name for p in presets]
    if FEWCLIP in names:
        raise ValueError(f"adapter {adapter!r}: {FEWCLIP!r} is fewclip's own default and holds no settings; "
                         f"give the preset another name")
    if len(set(names)) != len(names):
        raise ValueError(f"adapter {adapter!r}: preset names must differ, got {names}")
    return PRESETS.register(adapter, MethodPresets(adapter, tuple(presets), on_test))


def _table(adapter: str) -> Optional[MethodPresets]:
    return PRESETS.get(adapter) if adapter in PRESETS else None


def presets_of(adapter: str) -> dict[str, Preset]:
    """``{name: Preset}`` of a method, fewclip's own default first."""
    table = _table(adapter)
    return {FEWCLIP: DEFAULT, **({p.name: p for p in table.presets} if table else {})}


def get_preset(adapter: str, name: str) -> Preset:
    """The preset ``name`` of method ``adapter``; an unknown one is a one-line error listing the available."""
    found = presets_of(adapter)
    if name in found:
        return found[name]
    raise PresetError(f"unknown preset {name!r} for adapter {adapter!r}; its presets: {', '.join(found)} "
                      f"(`fewclip adapters {adapter}` lists what each sets)")


def preset_name_of(args: Sequence[str], yamls: Sequence[Mapping[str, Any]] = ()) -> str:
    """The preset named by the arguments: ``preset=NAME`` (the last one wins) or ``preset: NAME`` in one of the
    already-loaded YAML pieces ``yamls`` (in order; a dotlist argument wins over them). Default: fewclip."""
    name = FEWCLIP
    for piece in yamls:
        value = piece.get("preset", None)
        if value is not None:
            name = str(value)
    for a in args:
        if a.startswith("preset="):
            name = a.split("=", 1)[1]
    return name


def preset_overrides(preset: Preset) -> dict[str, dict[str, Any]]:
    """The preset as a nested mapping to merge under the user's arguments: ``{"adapter": {...}, "train": {...}}``."""
    out: dict[str, dict[str, Any]] = {}
    for s in preset.settings:
        section, _, leaf = s.key.partition(".")
        out.setdefault(section, {})[leaf] = s.value
    return out


def in_effect(preset: Preset, current: Mapping[str, Any]) -> dict[str, Any]:
    """The preset's values that the final config still holds (``current``: key -> value); the others were
    overridden by the user's explicit arguments."""
    return {k: v for k, v in preset.values().items() if current.get(k) == v}


def check_test_choice(adapter: str, select: Any) -> None:
    """``train.select=test`` (keeping what scores best on the test set) is refused for every method, with what
    the method's authors did where they did choose on test."""
    if select != "test":
        return
    table = _table(adapter)
    did = table.on_test if table and table.on_test else f"the authors of {adapter} do not choose on test either"
    raise PresetError(f"train.select=test is refused: fewclip never chooses anything on the test set ({did}); "
                      f"use train.select=val (few-shot validation split) or last")


def method_label(adapter: str, preset: str) -> str:
    """How runs, tables and folders name a method run with a preset: ``tip_adapter[authors]``."""
    return adapter if preset == FEWCLIP else f"{adapter}[{preset}]"


def parse_label(label: str) -> tuple[str, str]:
    """``"tip_adapter[authors]"`` -> ``("tip_adapter", "authors")``; a plain name -> ``(name, "fewclip")``."""
    if label.endswith("]") and "[" in label:
        name, _, preset = label[:-1].partition("[")
        return name, preset
    return label, FEWCLIP


def _fmt(v: Any) -> str:
    return "null" if v is None else str(v)


def describe_presets(adapter: str, defaults: Mapping[str, Any]) -> list[str]:
    """What ``fewclip adapters NAME`` prints: each preset with the fields it changes (``defaults``: key ->
    fewclip's default value), their sources and reasons, what it cannot express, and what is refused."""
    lines = []
    for name, p in presets_of(adapter).items():
        lines.append(f"preset={name}: {p.summary}" + ("" if name == FEWCLIP or p.settings else
                                                        " (no field differs from fewclip's)"))
        for s in p.settings:
            lines.append(f"  {s.key}: {_fmt(defaults.get(s.key))} -> {_fmt(s.value)}  [{s.source}] {s.reason}")
        lines += [f"  not expressed: {n}" for n in p.not_expressed]
    table = _table(adapter)
    if table and table.on_test:
        lines.append(f"refused (chosen on test by the authors): {table.on_test}")
    return lines


def markdown_rows(adapters: Sequence[str], defaults: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The manual's table (docs/concepts/presets.md): one row per preset setting and per difference a preset cannot express."""
    rows = ["| method | preset | field | fewclip | preset's | source | why |", "|---|---|---|---|---|---|---|"]
    for a in adapters:
        for name, p in presets_of(a).items():
            if name == FEWCLIP:
                continue
            for s in p.settings:
                rows.append(f"| {a} | {name} | `{s.key}` | {_fmt(defaults[a].get(s.key))} | {_fmt(s.value)} | "
                            f"{s.source} | {s.reason} |")
            for n in p.not_expressed:
                rows.append(f"| {a} | {name} | (not a field) | | | | {n} |")
            if not p.settings and not p.not_expressed:
                rows.append(f"| {a} | {name} | (none) | | | | {p.summary} |")
    return rows


__all__ = ["FEWCLIP", "PRESETS", "MethodPresets", "Preset", "PresetError", "Setting", "check_test_choice",
           "describe_presets", "get_preset", "in_effect", "markdown_rows", "method_label", "parse_label",
           "preset_name_of", "preset_overrides", "presets_of", "register_presets"]
