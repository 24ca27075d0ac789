"""A page per method, generated at build time from fewclip's registries (a mkdocs hook, ``hooks:`` in mkdocs.yml).

For every name in ``fewclip.adapter.base.ADAPTERS`` (fewclip's own methods and any installed plugin's, found through
the same entry points) ``method_page(name)`` writes ``methods/<name>.md``: the module's docstring, every option of
its config dataclass with its help, type and default (``field(metadata={"help": ...})``), its own training defaults
(``adapter_cls.train_defaults``), its presets with their sources (``fewclip.config.presets``), its parity test and
the largest difference measured, its published numbers (``fewclip/published/results.csv``) and what it becomes in
each geometry. The facts the registry does not hold (paper, parity, geometry) come from ``docs/data/methods.yaml``;
a method without an entry there (a plugin's) gets the same page without them. Plain Python: ``method_page`` is
importable without mkdocs (tests/test_docs.py calls it on a fake method).
"""
from __future__ import annotations

import csv
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

DOCS = Path(__file__).resolve().parent.parent
DATA = DOCS / "data" / "methods.yaml"


def _registry():
    from fewclip.adapter.base import ADAPTERS  # imported late: the docs build is the only caller that needs torch

    return ADAPTERS


def method_facts() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(DATA.read_text()) or {}


def _cell(v: Any) -> str:
    """A value as a table cell: YAML-ish scalars in code, pipes escaped."""
    if v is None:
        text = "null"
    elif isinstance(v, bool):
        text = str(v).lower()
    elif isinstance(v, (list, tuple, dict)):
        text = yaml.safe_dump(v if not isinstance(v, tuple) else list(v), default_flow_style=True,
                              width=1 << 16).strip()
    else:
        text = str(v)
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _text(s: str) -> str:
    return " ".join(str(s).split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "(required)"


def option_rows(config_cls) -> list[str]:
    from fewclip.config.help import field_help

    rows = ["| option | type | default | help |", "|---|---|---|---|"]
    for f in dataclasses.fields(config_cls):
        if f.name == "name":
            continue
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `adapter.{f.name}` | `{_text(typ)}` | {_cell(_default(f))} | {_text(field_help(f)) or '-'} |")
    return rows


def published_rows(name: str, csv_path: Optional[Path] = None) -> list[dict[str, str]]:
    if csv_path is None:
        from fewclip.published import __file__ as pub

        csv_path = Path(pub).parent / "results.csv"
    with open(csv_path, newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["method"] == name]


def _docstring(info) -> str:
    module = sys.modules.get(info.adapter_cls.__module__)
    doc = inspect.getdoc(module) if module is not None else None
    return doc or inspect.getdoc(info.adapter_cls) or "(no docstring)"


def method_page(name: str, facts: Optional[dict[str, Any]] = None, csv_path: Optional[Path] = None) -> str:
    from fewclip.config.presets import FEWCLIP, PRESETS, presets_of

    registry = _registry()
    info = registry.get(name)
    facts = method_facts().get(name, {}) if facts is None else facts
    source = registry.source(name)
    out = [f"# `{name}`", ""]
    if facts.get("paper") or facts.get("tunes"):
        out += [f"**{_text(facts.get('paper', ''))}**" + (f" — tunes {facts['tunes']}." if facts.get("tunes") else ""), ""]
    trained = info.adapter_cls.trained_by
    how = {"loop": "the engine's training loop", "fit": "its own `fit` on cached features", None: "nothing to train"}
    out += [f"Registered by `{source}`; trained by {how.get(trained, trained)}. "
            f"`fewclip adapters {name}` prints the same options; `fewclip train adapter={name} --help` the whole "
            "config. The methods' shared sections are on [Methods](index.md).", ""]
    out += ["## What it does", "", _docstring(info), ""]
    out += ["## Options", "", f"Set with `adapter.OPTION=VALUE` (config class `{info.config_cls.__name__}`).", ""]
    out += option_rows(info.config_cls) + [""]
    out += ["## Training defaults", ""]
    td = dict(getattr(info.adapter_cls, "train_defaults", {}) or {})
    if td:
        out += ["The run's `train` section starts from these (an explicit `train.KEY=VALUE` wins):", "",
                "| key | value |", "|---|---|"]
        out += [f"| `train.{k}` | {_cell(v)} |" for k, v in td.items()] + [""]
    else:
        out += ["None of its own: the run's `train` defaults (CoOp's protocol, see [Methods](index.md))."
                if trained else "It trains nothing.", ""]
    out += ["## Presets", "", "`preset=NAME` (see [Presets](../concepts/presets.md)); "
            f"`preset={FEWCLIP}` (or none) is fewclip's own default.", ""]
    table = PRESETS.get(name) if name in PRESETS else None
    rows = []
    for pname, p in presets_of(name).items():
        if pname == FEWCLIP:
            continue
        for s in p.settings:
            rows.append(f"| `{pname}` | `{s.key}` | {_cell(s.value)} | {_text(s.source)} | {_text(s.reason)} |")
        for n in p.not_expressed:
            rows.append(f"| `{pname}` | (not a field) | | | {_text(n)} |")
        if not p.settings and not p.not_expressed:
            rows.append(f"| `{pname}` | (none) | | | {_text(p.summary)} |")
    if rows:
        out += ["| preset | field | value | source | why |", "|---|---|---|---|---|"] + rows + [""]
    else:
        out += ["No preset of its own.", ""]
    if table is not None and table.on_test:
        out += [f"Refused (chosen on the test set by the authors): {_text(table.on_test)}", ""]
    out += ["## Parity with the authors' code", ""]
    parity = facts.get("parity")
    if parity:
        out += [f"Pinned by `{parity['test']}`: largest difference {_text(parity['largest'])}.", ""]
    else:
        out += ["No parity test recorded for this method.", ""]
    out += ["## Published numbers", ""]
    pub = published_rows(name, csv_path)
    if pub:
        out += [f"{len(pub)} published result(s) from `fewclip/published/results.csv` "
                f"(`fewclip published method={name}`; see [Reproducibility](../reproducibility.md)):", "",
                "| backbone | dataset | protocol | shots | metric | value | source |", "|---|---|---|---:|---|---:|---|"]
        out += [f"| {r['backbone']} | {r['dataset']} | {r['protocol']} | {r['shots']} | {r['metric']} | {r['value']} | "
                f"{_text(r['source'])} |" for r in pub] + [""]
    else:
        out += ["None in `fewclip/published/results.csv`.", ""]
    out += ["## In each geometry", ""]
    geo = facts.get("geometry")
    if geo:
        out += ["| geometry | what it becomes |", "|---|---|"]
        out += [f"| {_text(g)} | {_text(t)} |" for g, t in geo.items()] + [""]
    else:
        out += ["It goes through the backbone's geometry like every method (see "
                "[Geometries](../concepts/geometries.md)); no geometry-specific form is recorded for it.", ""]
    return "\n".join(out) + "\n"


# -- mkdocs hook --------------------------------------------------------------------------------------------------
def on_config(config):
    """Every registered method's page goes into the nav's "Methods" section, after its hand-written pages."""
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Methods" in item:
            item["Methods"] = [e for e in item["Methods"] if not (isinstance(e, dict) and "Each method" in e)]
            item["Methods"].append({"Each method": [{n: f"methods/{n}.md"} for n in _registry().names()]})
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for name in _registry().names():
        files.append(File.generated(config, f"methods/{name}.md", content=method_page(name)))
    return files
