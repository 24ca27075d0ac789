"""Class names and prompt templates from files, as CLIP_benchmark takes them (``data.classnames=FILE``,
``data.prompts_file=FILE``).

Class names (``read_classnames``), by the file's suffix:

* ``.json`` / ``.yaml`` / ``.yml``: a mapping from the dataset's own class name (a ``folder`` dataset's: the
  folder name) to the name to use, ``{"nominal": "a woven textile without defects"}`` (classes it leaves out keep
  their name); or a list, one name per class in label order; or CLIP_benchmark's file, a mapping from dataset
  names to such lists, of which the dataset's own entry is used;
* ``.csv``: rows ``folder,name`` (a header row ``folder,classname`` or similar is skipped), or one name a row;
* anything else (``.txt``): one name a line, in label order.

Prompt templates (``read_templates``): ``.json`` / ``.yaml``: a list (or CLIP_benchmark's mapping from dataset
names to lists); otherwise one template a line. ``{}`` or CLIP_benchmark's ``{c}`` stands for the class name.
Blank lines and lines starting with ``#`` are skipped in line files. Files are parsed as data: nothing in them
is executed (``yaml.safe_load``, ``json``).
"""
from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import yaml

from fewclip.utils.errors import InputError


class NameFileError(InputError):
    """A class-name or template file that cannot be used; the message names the file and the fix."""


def _read_text(path: str | Path, key: str) -> str:
    p = Path(path).expanduser()
    try:
        return p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise NameFileError(f"{key}={path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise NameFileError(f"{key}={path}: cannot be read ({e}); give a UTF-8 text file") from None


def _structured(path: str | Path, key: str) -> Optional[Any]:
    """The parsed content of a JSON or YAML file (None for another suffix)."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        return None
    text = _read_text(path, key)
    try:
        return json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise NameFileError(f"{key}={path}: not valid {suffix[1:].upper()} ({str(e).splitlines()[0]})") from None


def _lines(path: str | Path, key: str) -> list[str]:
    return [line.strip() for line in _read_text(path, key).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _as_class(key: str, classnames: Sequence[str]) -> str:
    """A mapping's key as one of ``classnames``: itself, or a folder name as the folder reader cleans it."""
    if key in classnames:
        return key
    cleaned = " ".join(key.replace("_", " ").split())
    return cleaned if cleaned in classnames else key


def _benchmark_entry(data: dict[str, Any], dataset: str, known: Sequence[str]) -> Optional[list[Any]]:
    """CLIP_benchmark's layout ({dataset: [names]}): the dataset's own list, when the mapping is one."""
    if all(isinstance(v, list) for v in data.values()) and not ({_as_class(str(k), known) for k in data} & set(known)):
        if dataset in data:
            return data[dataset]
        raise NameFileError(f"the file maps dataset names to lists ({', '.join(map(str, list(data)[:5]))}), but "
                            f"not {dataset!r}: add an entry for it")
    return None


def read_classnames(path: str | Path, classnames: Sequence[str], dataset: str = "",
                    key: str = "data.classnames") -> list[str]:
    """The class names ``path`` gives the dataset whose own names are ``classnames`` (label order)."""
    data = _structured(path, key)
    if data is None and Path(path).suffix.lower() == ".csv":
        rows = [[c.strip() for c in r] for r in csv.reader(_read_text(path, key).splitlines()) if any(c.strip() for c in r)]
        if rows and all(len(r) >= 2 for r in rows):
            if _as_class(rows[0][0], classnames) not in classnames:  # a header row
                rows = rows[1:]
            data = {r[0]: r[1] for r in rows}
        else:
            data = [r[0] for r in rows if r]
    elif data is None:
        data = _lines(path, key)
    try:
        if isinstance(data, dict):
            entry = _benchmark_entry(data, dataset, classnames)
            if entry is not None:
                data = entry
        if isinstance(data, dict):  # keys: the folder names (golden_retriever) or the names they give
            data = {_as_class(str(k), classnames): v for k, v in data.items()}
            unknown = [k for k in data if k not in classnames]
            if unknown:
                raise NameFileError(f"{', '.join(map(repr, unknown[:5]))} {'is' if len(unknown) == 1 else 'are'} "
                                    f"not class(es) of the dataset ({', '.join(classnames[:8])}"
                                    f"{' ...' if len(classnames) > 8 else ''}); map its folder names")
            return [str(data.get(c, c)) for c in classnames]
        if isinstance(data, list):
            if len(data) != len(classnames):
                raise NameFileError(f"{len(data)} name(s) for {len(classnames)} classes; a list gives one name per "
                                    f"class in label order ({', '.join(classnames[:5])}{' ...' if len(classnames) > 5 else ''})"
                                    f", or use a mapping from folder name to class name")
            return [str(x) for x in data]
    except NameFileError as e:
        raise NameFileError(f"{key}={path}: {e}") from None
    raise NameFileError(f"{key}={path}: expected a mapping from folder name to class name or a list of names, "
                        f"got {type(data).__name__}")


def read_templates(path: str | Path, dataset: str = "", key: str = "data.prompts_file") -> list[str]:
    """The prompt templates in ``path``, each with ``{}`` for the class name."""
    data = _structured(path, key)
    if data is None:
        data = _lines(path, key)
    if isinstance(data, dict):
        if dataset in data and isinstance(data[dataset], list):
            data = data[dataset]
        else:
            raise NameFileError(f"{key}={path}: a mapping of dataset names to template lists without {dataset!r}; "
                                f"give a list of templates or add an entry for it")
    if not isinstance(data, list) or not data:
        raise NameFileError(f"{key}={path}: expected a list of templates (one a line, or a JSON/YAML list), got "
                            f"{'nothing' if not data else type(data).__name__}")
    templates = [str(t).replace("{c}", "{}") for t in data]
    bad = [t for t in templates if t.count("{}") != 1]
    if bad:
        raise NameFileError(f"{key}={path}: each template needs exactly one '{{}}' (or '{{c}}') for the class name; "
                            f"bad: {bad[:3]}")
    return templates
