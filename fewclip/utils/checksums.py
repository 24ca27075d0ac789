"""Checksums of files, bytes and model state, used by run records, the feature store and exports."""
from __future__ import annotations

import ast
import hashlib
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the dataset modules use code_sha256
    import torch


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def code_sha256(*paths: str | os.PathLike) -> str:
    """A checksum of what Python modules do: each file's syntax tree without its docstrings, comments, layout and
    line numbers. An edit of a docstring or comment keeps it; any edit of the code changes it. The tree's text
    comes from ``ast.dump``, which a new Python version may spell differently (a one-off change of the checksum)."""
    h = hashlib.sha256()
    for path in paths:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(ast.dump(tree, include_attributes=False).encode())
        h.update(b"\0")
    return h.hexdigest()


def state_sha256(model: torch.nn.Module) -> str:
    """A checksum of a model's state dict (names, shapes, float32 values), for weights without a file checksum."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu()
        t = (t.float() if t.is_floating_point() else t).contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


_STATE_SHA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_checksum(backbone) -> str:
    """The backbone's weights file sha256, or the sha256 of its state dict where it has no file.

    The state-dict checksum is computed once per backbone object, when first asked (a sweep asks before
    any run, so an adapter that changes the towers in place cannot change it)."""
    if getattr(backbone, "weights_sha256", None):
        return f"file:{backbone.weights_sha256}"
    if backbone not in _STATE_SHA:
        _STATE_SHA[backbone] = f"state:{state_sha256(backbone.model)}"
    return _STATE_SHA[backbone]
