"""The commands that load no model: ``fewclip report``, ``fewclip datasets`` and the listing ``fewclip adapters``,
and the argument parsing every command shares (``parse_command``).

Light: nothing here imports torch or open_clip (``fewclip.cli.commands``, the commands that load models, costs
seconds to import), so a report or a listing answers at once; a ``datasets check`` of a feature file loads torch
through that dataset's reader. ``fewclip adapters`` lists the built-in methods from the adapter index
(``fewclip.adapter.index``); with a method named, a plugin's method installed or an index that does not match the
sources, it imports the methods (``fewclip.cli.commands``).
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from fewclip.adapter.index import load_index
from fewclip.cli.quickhelp import method_section
from fewclip.cli.table import BY_NAME, HEAVY  # each command's usage line; the module of the commands that load models
from fewclip.config.compose import ConfigError, RunConfig, compose, load_config, to_object
from fewclip.config.help import describe_config
from fewclip.config.report import ReportOptions
from fewclip.data.base import DATASETS, build_dataset
from fewclip.data.image_check import describe_bad, find_bad_images, n_images
from fewclip.report import write_report
from fewclip.utils.registry import plugin_entry_points


@dataclasses.dataclass
class NoOptions:
    """A command that takes positional arguments only."""


def parse_command(command: str, args: Sequence[str], schema: type):
    """``(options, positionals)`` of a command's arguments: ``key=value`` pairs composed into ``schema`` (a
    dataclass; unknown keys and wrong types fail naming the key), everything else positional."""
    keyvals = [a for a in args if "=" in a and not a.startswith("-")]
    positionals = [a for a in args if "=" not in a and not a.startswith("-")]
    base = OmegaConf.structured(schema)
    for f in dataclasses.fields(schema):  # a mapping option (report's rename) takes keys the user chooses
        if isinstance(getattr(schema(), f.name), dict):
            OmegaConf.set_struct(base[f.name], False)
    try:
        return to_object(compose(schema, keyvals, base=base)), positionals
    except ConfigError as e:
        raise ConfigError(f"{e}; {BY_NAME[command].usage}") from None


def cmd_datasets_check(args: Sequence[str]) -> int:
    """``fewclip datasets check data=NAME data.root=PATH``: every image file of the dataset read once; the
    unreadable ones listed (exit 1), with the setting that leaves them out."""
    data = load_config([a for a in args if not a.startswith("-")], RunConfig).data
    if data.skip_bad_images:
        raise ConfigError("fewclip datasets check lists the unreadable files; leave data.skip_bad_images out")
    dataset = build_dataset(data)
    if getattr(dataset, "root", None) is None:
        print(f"{dataset.name}: its images are made by code; no files to check")
        return 0
    total = n_images(dataset)
    bad = find_bad_images(dataset)
    if not bad:
        print(f"{dataset.name}: all {total} images under {dataset.root} can be read")
        return 0
    print(describe_bad(dataset, bad, total))
    print("data.skip_bad_images=true leaves them out of every run (metrics.json records which), or fix or remove "
          "the files")
    return 1


def cmd_datasets(args: Sequence[str]) -> int:
    if args and args[0] == "check":
        return cmd_datasets_check(args[1:])
    for info in sorted(DATASETS.values(), key=lambda i: (i.needs_root, i.name)):
        print(f"{info.name}\n  {info.description}")
        where = "  no files needed" if not info.needs_root else "  data.root=PATH, expected layout:\n" + "\n".join(
            "    " + line for line in info.layout.splitlines())
        print(where)
    return 0


def cmd_report(args: Sequence[str]) -> int:
    options, paths = parse_command("report", args, ReportOptions)
    if not paths:
        raise ConfigError(BY_NAME["report"].usage)
    rep = write_report([Path(p) for p in paths], options=options)
    print(rep.markdown)
    print("report: " + ", ".join(str(p) for p in rep.paths.values()))
    return 0


def method_lines(name: str, head: str, section, train: dict[str, Any], tail: Sequence[str]) -> list[str]:
    """One method in ``fewclip adapters``: ``name: head``, its options with their help (``section``, its config
    dataclass or the index's stand-in), its own training defaults in their order, then ``tail``."""
    options = [line for line in describe_config(section) if not line.startswith("name:")]
    lines = [f"{name}: {head}", *(["  adapter." + line for line in options] if options else ["  no options"])]
    if train:
        lines.append("  its own training defaults: " + " ".join(f"train.{k}={v}" for k, v in train.items()))
    return lines + list(tail)


def presets_line(name: str, presets: Sequence[str]) -> str:
    return f"  presets: {', '.join(presets)} (`fewclip adapters {name}` lists what each sets)"


def adapter_listing(methods: dict[str, Any]) -> Optional[list[str]]:
    """The lines of ``fewclip adapters`` (every method) from the adapter index, as ``fewclip.cli.commands`` prints
    them from the imported methods; None where a method's section cannot be rebuilt from the index."""
    lines = []
    for name in sorted(methods):
        entry = methods[name]
        section = method_section(entry)
        if section is None:
            return None
        train = {k: entry["train_defaults"][k] for k in entry["train_order"]}  # the file's keys are sorted
        lines += method_lines(name, entry["summary"], section, train, [presets_line(name, entry["presets"])])
    return lines


def cmd_adapters(args: Sequence[str]) -> int:
    """Every registered method, its options with their help, and its own training defaults (from the index where
    every method is fewclip's own); a method named: also its presets, field by field (imports the methods)."""
    _, names = parse_command("adapters", args, NoOptions)
    methods = None if names else load_index()
    plugins = plugin_entry_points("fewclip.adapters")
    lines = adapter_listing(methods) if methods is not None and not plugins else None
    if lines is None:
        # Imported here: the methods' modules load torch and open_clip (seconds), which the listing from the index
        # does not need.
        return importlib.import_module(HEAVY).cmd_adapters(args)
    print("\n".join(lines))
    return 0
