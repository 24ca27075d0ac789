"""The commands that load no model: ``fewclip report`` and ``fewclip datasets``, and the argument parsing every
command shares (``parse_command``).

Light: nothing here imports torch or open_clip (``fewclip.cli.commands``, the commands that load models, costs
seconds to import), so a report or a listing answers at once; a ``datasets check`` of a feature file loads torch
through that dataset's reader.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from fewclip.cli.table import BY_NAME  # each command's usage line
from fewclip.config.compose import ConfigError, RunConfig, compose, load_config, to_object
from fewclip.config.report import ReportOptions
from fewclip.data.base import DATASETS, build_dataset
from fewclip.data.image_check import describe_bad, find_bad_images, n_images
from fewclip.report import write_report


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


