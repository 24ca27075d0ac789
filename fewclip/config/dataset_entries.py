"""The datasets of a sweep: ``sweep.datasets`` entries, each a dataset with its own arguments.

An entry is

* a name: a registered dataset (``toy-shapes``, ``caltech101``, ``folder``), read with the sweep's ``args``;
* a mapping of ``data`` keys: ``{name: folder, root: /data/pets}`` (a folder dataset, named ``pets`` after its
  folder), ``{name: cars, reader: folder, root: /data/cars/train, templates: single, prompts: ["a photo of a
  {}, a type of car."]}``;
* a YAML piece (``data/pets.yaml``): a file whose ``data:`` section (or the whole file) is such a mapping.

Each entry's runs get its keys as ``data.KEY=VALUE`` arguments after the sweep's ``args`` (an entry's own
setting wins), and the entry is known by its dataset's name (``fewclip.datasets.dataset_name``): in run
folders (``BACKBONE/NAME/METHOD/...``), tables, the feature store and ``sweep.targets``. Two entries of one
name are an error.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fewclip.config.compose import ConfigError, find_yaml, load_yaml
from fewclip.data.base import DataConfig, dataset_name

DATA_KEYS = tuple(f.name for f in fields(DataConfig))


@dataclass(frozen=True)
class SweepDataset:
    """One dataset of a sweep: its name and the arguments its runs get."""

    name: str
    args: tuple[str, ...]


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _mapping(entry: Any, where: str) -> dict:
    """An entry's ``data`` keys: a mapping as given, or a YAML piece's ``data:`` section (or whole file)."""
    entry = _plain(entry)
    if isinstance(entry, str):
        where = f"{where} ({entry})"
        piece = OmegaConf.to_container(load_yaml(find_yaml(entry)), resolve=True)
        entry = piece.get("data", piece) if isinstance(piece, dict) else piece
        if isinstance(entry, str):
            entry = {"name": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a dataset entry is a name, a mapping of data keys or a YAML piece, got "
                          f"{type(entry).__name__}")
    unknown = sorted(set(entry) - set(DATA_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown data key(s) {', '.join(unknown)}; allowed: {', '.join(DATA_KEYS)}")
    if "name" not in entry:
        raise ConfigError(f"{where}: a dataset entry needs a name (a registered dataset, or your own with reader: "
                          f"folder)")
    return entry


def _data_config(args: Sequence[str], where: str) -> DataConfig:
    """The data section that ``args`` (``data=``/``data.KEY=`` arguments) give, checked."""
    node = OmegaConf.structured(DataConfig)
    OmegaConf.set_struct(node, True)
    dotlist = []
    for a in args:
        key, _, value = a.partition("=")
        if key == "data":
            dotlist.append(f"name={value}")
        elif key.startswith("data."):
            dotlist.append(f"{key[5:]}={value}")
    try:
        node = OmegaConf.merge(node, OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def sweep_datasets(entries: Sequence[Any], sweep_args: Sequence[str] = ()) -> list[SweepDataset]:
    """The sweep's datasets (module docstring), in order; ``sweep_args``: the sweep's ``args``, which come
    before an entry's own keys."""
    out: list[SweepDataset] = []
    for i, entry in enumerate(entries):
        where = f"sweep.datasets[{i}]"
        entry = _plain(entry)
        if isinstance(entry, str) and not entry.endswith((".yaml", ".yml")):
            args: tuple[str, ...] = (f"data={entry}",)
        else:
            args = tuple(f"data.{k}={json.dumps(v)}" for k, v in _mapping(entry, where).items())
        data = _data_config([*sweep_args, *args], where)
        out.append(SweepDataset(dataset_name(data), args))
    seen = {}
    for d in out:
        if d.name in seen:
            raise ConfigError(f"sweep.datasets: two entries are the dataset {d.name!r} ({' '.join(seen[d.name])} and "
                              f"{' '.join(d.args)}); name each one: {{name: NAME, reader: folder, root: PATH}}")
        seen[d.name] = d.args
    return out
