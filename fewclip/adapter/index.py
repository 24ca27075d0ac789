"""The built-in methods' config sections as data, so that ``fewclip train --help`` prints a method's options
without importing the method (and torch).

``fewclip/adapter/index.json`` holds, for every method of the ``fewclip.adapters`` package, its config dataclass's
fields (name, type, default, help), its own ``train`` defaults, whether it trains on images, the first line of its
module's docstring and its presets' names (``fewclip adapters`` lists the methods from it: fewclip.cli.light). It
is made from the registered adapters by

    python -m fewclip.adapter.index

and carries a fingerprint of the sources it was made from (the ``fewclip.adapters`` package, the repository's ``adapters/``, and
``fewclip/config/sections.py``). A file that does not match the sources in use is ignored: the help then imports the
methods, as it always may. ``tests/test_quickhelp.py`` fails when the committed file is out of date, and checks
that the help printed from it equals the help printed from the methods themselves.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Optional

from fewclip.config.presets import presets_of

INDEX_FILE = Path(__file__).with_name("index.json")
FORMAT = 2  # 2: each method's summary and preset names


def _sources():
    """The files the index is made from, in a fixed order."""
    spec = importlib.util.find_spec("fewclip.adapters")  # the repository's adapters/ folder
    if spec is None or spec.origin is None:
        return []
    root = Path(spec.origin).parent
    return [(p.relative_to(root).as_posix(), p) for p in sorted(root.rglob("*.py"))] + \
        [("fewclip/config/sections.py", Path(__file__).parents[1] / "config" / "sections.py")]


def source_fingerprint() -> str:
    """sha256 over the names and bytes of the source files (a few hundred kB: about a millisecond)."""
    h = hashlib.sha256()
    for name, path in _sources():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def summary_of(adapter_cls: type) -> str:
    """A method's one-line summary: the first line of its module's docstring."""
    doc = (importlib.import_module(adapter_cls.__module__).__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def build_index() -> dict[str, Any]:
    """The index of the registered methods that ``fewclip.adapters`` defines (imports them, and torch)."""
    from fewclip.adapter.base import ADAPTERS  # the one place that needs the methods: building the file

    methods = {}
    for name, info in sorted(ADAPTERS.items()):
        if not info.adapter_cls.__module__.startswith("fewclip.adapters."):
            continue  # a plugin's method: its sources are not fingerprinted, so its help imports it
        default = info.config_cls()
        fields = [{"name": f.name, "type": str(f.type), "default": getattr(default, f.name),
                   "help": str(f.metadata.get("help", "")) if f.metadata else ""}
                  for f in dataclasses.fields(info.config_cls)]
        methods[name] = {"config": info.config_cls.__name__, "fields": fields, "trains": info.trains,
                         "train_defaults": dict(info.adapter_cls.train_defaults),
                         "train_order": list(info.adapter_cls.train_defaults),  # the file's keys are sorted
                         "summary": summary_of(info.adapter_cls), "presets": list(presets_of(name))}
    return {"format": FORMAT, "fingerprint": source_fingerprint(), "methods": methods}


def load_index(path: Path = INDEX_FILE) -> Optional[dict[str, Any]]:
    """The index's methods, or None when the file is missing, of another format or made from other sources."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if index.get("format") != FORMAT or index.get("fingerprint") != source_fingerprint():
        return None
    return index["methods"]


def write_index(path: Path = INDEX_FILE) -> Path:
    path.write_text(json.dumps(build_index(), indent=1, sort_keys=True) + "\n")
    return path


if __name__ == "__main__":
    print(f"wrote {write_index(Path(sys.argv[1]) if len(sys.argv) > 1 else INDEX_FILE)}")
