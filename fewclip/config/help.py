"""Help as data: a config dataclass printed as ``key: default  # help``, the help taken from each field's
``metadata={"help": ...}`` (PEFT's habit), so what ``--help`` and ``fewclip adapters`` print cannot drift from
the code. Light on purpose (no torch): ``fewclip report --help`` uses it without loading any model code."""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import yaml


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple, dict)):
        if not value:
            return "{}" if isinstance(value, dict) else "[]"
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return str(value)


def field_help(f) -> str:
    """The help text of a dataclass field (``field(metadata={"help": ...})``), or ""."""
    return str(f.metadata.get("help", "")) if f.metadata else ""


def describe_config(obj: Any, indent: str = "") -> list[str]:
    """A config dataclass as ``key: default  # help`` lines, sections indented (``--help``, ``fewclip adapters``)."""
    lines: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        text = field_help(f)
        note = f"  # {text}" if text else ""
        if is_dataclass(value):
            lines.append(f"{indent}{f.name}:{note}")
            lines.extend(describe_config(value, indent + "  "))
        else:
            lines.append(f"{indent}{f.name}: {_scalar(value)}{note}")
    return lines
