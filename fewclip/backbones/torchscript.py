"""Read the tensors of a TorchScript archive without running anything from it.

OpenAI publishes its CLIP checkpoints as TorchScript archives (``torch.jit.save``
of a traced model), which ``torch.load(weights_only=True)`` refuses and
``torch.jit.load`` would load by compiling the code stored in the archive. The
tensors themselves are plain data: a TorchScript archive is a zip holding

- ``code/**/*.py``: the class of every module, which declares its parameter and
  buffer names (``__parameters__ = ["weight", "bias", ]``, ``__buffers__ = [...]``);
- ``data.pkl``: a pickle of the module tree, each module an object of one of
  those classes whose state is a dict of its attributes (tensors, child modules,
  flags);
- ``data/N``: the raw bytes of storage ``N``.

``read_torchscript_state_dict`` rebuilds the module's ``state_dict()`` from these
alone: the class declarations are read as text (``ast.literal_eval`` of the two
lists, nothing executed), and ``data.pkl`` goes through an unpickler that knows
only how to make tensors from storages and empty placeholder objects that keep
their state; any other global in the pickle is refused. Tested against
``torch.jit.load(...).state_dict()`` on archives made with ``torch.jit.trace``
and ``torch.jit.script``.
"""
from __future__ import annotations

import ast
import collections
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

# Storage classes as they appear in TorchScript pickles ("torch FloatStorage") and their dtypes.
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "DoubleStorage": torch.float64,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_CLASS = re.compile(r"^class\s+(\w+)\s*\(", re.MULTILINE)
_DECL = re.compile(r"^\s+(__parameters__|__buffers__)\s*=\s*(\[[^\]]*\])", re.MULTILINE)


class TorchScriptError(ValueError):
    """The archive is not one this reader understands; the message says why."""


def archive_prefix(path: str | Path) -> str | None:
    """The folder name inside ``path`` if it is a TorchScript archive (a zip with ``code/`` and
    ``data.pkl``), else ``None``."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    pkl = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    prefix = pkl[0].split("/")[0]
    return prefix if any(n.startswith(f"{prefix}/code/") for n in names) else None


def _declarations(z: zipfile.ZipFile, prefix: str) -> dict[str, tuple[list[str], list[str]]]:
    """Qualified class name -> (parameter names, buffer names), read as text from ``code/``."""
    decls: dict[str, tuple[list[str], list[str]]] = {}
    code = f"{prefix}/code/"
    for name in z.namelist():
        if not (name.startswith(code) and name.endswith(".py")):
            continue
        module = name[len(code):-len(".py")].replace("/", ".")
        try:
            text = z.read(name).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TorchScriptError(f"the archive's {name} is not UTF-8 text (byte {e.start}); the archive is "
                                   f"damaged or not made by torch.jit.save") from None
        starts = [(m.start(), m.group(1)) for m in _CLASS.finditer(text)]
        for i, (pos, cls) in enumerate(starts):
            body = text[pos: starts[i + 1][0] if i + 1 < len(starts) else len(text)]
            lists = {k: _names(v, f"{name}: class {cls}'s {k}") for k, v in _DECL.findall(body)}
            decls[f"{module}.{cls}"] = (lists.get("__parameters__", []), lists.get("__buffers__", []))
    return decls


def _names(text: str, where: str) -> list[str]:
    """A declaration's list of names (``["weight", "bias", ]``), read as a literal; anything else is an error."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # what literal_eval raises on non-literals
        value = None
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise TorchScriptError(f"{where} is not a list of names ({text[:60]!r}); the archive is damaged or not made "
                               f"by torch.jit.save")
    return value


class _ScriptObject:
    """Placeholder for an object of a TorchScript class: keeps the state the pickle gives it."""

    qualname = ""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Unpickler(pickle.Unpickler):
    """Knows tensors (from the archive's storages), OrderedDict and TorchScript placeholders; refuses the rest."""

    def __init__(self, file, z: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self._z, self._prefix = z, prefix
        self._classes: dict[str, type] = {}
        self._storages: dict[str, torch.Tensor] = {}
        self.byteorder = "little"

    def find_class(self, module: str, name: str):
        if module == "__torch__" or module.startswith("__torch__."):
            qual = f"{module}.{name}"
            if qual not in self._classes:
                self._classes[qual] = type(name, (_ScriptObject,), {"qualname": qual})
            return self._classes[qual]
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_tensor_v3"):
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, requires_grad, hooks: data
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        what = "a quantized tensor" if name == "_rebuild_qtensor" else f"{module}.{name}"
        raise TorchScriptError(f"the archive's data.pkl refers to {what}, which this reader does not rebuild")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchScriptError(f"unexpected persistent id in data.pkl: {pid!r}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise TorchScriptError(f"unexpected storage type in data.pkl: {dtype!r}")
        if key not in self._storages:
            raw = bytearray(self._z.read(f"{self._prefix}/data/{key}"))
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            if flat.numel() < numel:
                raise TorchScriptError(f"storage {key} holds {flat.numel()} values, the pickle says {numel}")
            self._storages[key] = flat
        return self._storages[key]


def _rebuild_tensor(storage: torch.Tensor, offset: int, size, stride, *args) -> torch.Tensor:
    """A tensor viewing ``storage`` (a flat tensor), copied so that it owns its memory."""
    return storage.as_strided(tuple(size), tuple(stride), offset).clone()


def read_torchscript_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The ``state_dict()`` of the module saved in TorchScript archive ``path``, code never run."""
    prefix = archive_prefix(path)
    if prefix is None:
        raise TorchScriptError(f"{path} is not a TorchScript archive")
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        order = f"{prefix}/byteorder"
        if order in names and z.read(order).decode().strip() != "little":
            raise TorchScriptError(f"{path} stores big-endian tensors; only little-endian archives are read")
        decls = _declarations(z, prefix)
        with z.open(f"{prefix}/data.pkl") as f:
            try:
                root = _Unpickler(f, z, prefix).load()
            except TorchScriptError:
                raise
            except Exception as e:  # a malformed pickle: say so, never a traceback
                raise TorchScriptError(f"cannot read data.pkl: {type(e).__name__}: {e}") from None
    if not isinstance(root, _ScriptObject):
        raise TorchScriptError("the archive's data.pkl does not hold a TorchScript module")
    out: dict[str, torch.Tensor] = {}
    _collect(root, "", decls, out, set())
    return out


def _collect(obj: _ScriptObject, prefix: str, decls, out: dict[str, torch.Tensor], above: set) -> None:
    if id(obj) in above:  # a module that contains itself: a pickle can say so, torch.jit.save never does
        raise TorchScriptError(f"the archive's module tree has a cycle at {prefix.rstrip('.') or 'the root'}; "
                               f"the archive is damaged or not made by torch.jit.save")
    if obj.qualname not in decls:
        raise TorchScriptError(f"class {obj.qualname} has no declaration in the archive's code/")
    state = getattr(obj, "state", None)
    if not isinstance(state, dict):
        raise TorchScriptError(f"an object of class {obj.qualname} has no attribute dict")
    params, buffers = decls[obj.qualname]
    for name in params + buffers:
        value = state.get(name)
        if value is None:  # an optional parameter left unset (bias=False)
            continue
        if not isinstance(value, torch.Tensor):
            raise TorchScriptError(f"{prefix}{name} is declared a parameter or buffer but is not a tensor")
        out[prefix + name] = value
    for name, value in state.items():
        if isinstance(value, _ScriptObject):
            _collect(value, f"{prefix}{name}.", decls, out, above | {id(obj)})
