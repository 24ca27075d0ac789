"""One check for every tensor fewclip reads from a file: its dtype, its shape, its values, its checksum.

Feature files, exports of every format, prompt files, checkpoints and store entries are read by different
modules, each with its own error class (``DatasetError``, ``ExportError``, ``BackboneError``) and so its own
exit code; what a tensor must be is decided here once:

* ``tensor_problem(t, name, kind=, shape=)``: a phrase naming the first problem of one tensor (not a tensor,
  the wrong kind of values, the wrong shape, NaN or infinite values), or None;
* ``check_tensor`` / ``check_tensors``: the same, raised as the caller's error class with the file named;
* ``tensor_digests`` / ``check_digests``: a sha256 of each tensor's bytes (with its name, dtype and shape),
  written into an export's metadata and compared when it is loaded, so that bytes changed inside a tensor
  (which safetensors, having no checksum of its own, reads without complaint) are refused with the tensor
  named;
* ``check_state_tensors``: a state dict read from a file against the module state it is loaded into (same
  kind of values and shape for every key both have; finite floats).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch

Dim = Union[int, str, None]  # an int must match; a str or None matches any size (a str names it in messages)

FLOAT = "float"
INT = "int"
ANY = "any"


def _shape_text(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def tensor_problem(t, name: str, *, kind: str = FLOAT, shape: Optional[Sequence[Dim]] = None,
                   finite: bool = True) -> Optional[str]:
    """What is wrong with the tensor ``t`` called ``name``, in a phrase, or None. ``kind``: ``"float"``
    (floating point), ``"int"`` (an integer dtype, bool excluded) or ``"any"``; ``shape``: the expected shape
    (``Dim``s); ``finite``: floating values must be finite."""
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor ({type(t).__name__})"
    if kind == FLOAT and not t.is_floating_point():
        return f"{name} holds {str(t.dtype).replace('torch.', '')} values where floating-point values belong"
    if kind == INT and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        return f"{name} holds {str(t.dtype).replace('torch.', '')} values where integers belong"
    if shape is not None and (t.dim() != len(shape) or any(isinstance(d, int) and t.shape[i] != d
                                                            for i, d in enumerate(shape))):
        return f"{name} has shape {list(t.shape)}, expected {_shape_text(shape)}"
    if finite and t.is_floating_point():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            return f"{name} holds {int(bad.sum())} NaN or infinite value(s)"
    return None


def check_tensor(t, name: str, where: str, error: type[Exception] = ValueError, fix: str = "", **spec) -> None:
    """Raise ``error(f"{where}: {problem}{fix}")`` where ``tensor_problem`` finds one."""
    problem = tensor_problem(t, name, **spec)
    if problem:
        raise error(f"{where}: {problem}{fix}")


def check_tensors(tensors: Mapping[str, torch.Tensor], where: str, error: type[Exception] = ValueError,
                  fix: str = "") -> None:
    """Every tensor of a file: a tensor, finite where floating point (no dtype or shape asked)."""
    for name, t in tensors.items():
        check_tensor(t, repr(name), where, error, fix, kind=ANY)


def check_state_tensors(tensors: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], where: str,
                        error: type[Exception] = ValueError, fix: str = "") -> None:
    """``tensors`` (read from a file) against ``reference`` (the module state they are loaded into): for each
    key both have, the same kind of values (floating point or not) and the same shape (any size where the
    reference's is 0); floats finite. Keys
    only one of them has are left to the loader, which names them."""
    for name, t in tensors.items():
        ref = reference.get(name)
        if ref is None:
            check_tensor(t, repr(name), where, error, fix, kind=ANY)
            continue
        kind = FLOAT if ref.is_floating_point() else ANY
        # an empty dimension is a buffer that training fills (Tip-Adapter's cache): any size there
        shape = tuple(None if d == 0 else d for d in ref.shape)
        problem = tensor_problem(t, repr(name), kind=kind, shape=shape)
        if problem is None and not ref.is_floating_point() and t.is_floating_point():
            problem = f"{name!r} holds floating-point values where {str(ref.dtype).replace('torch.', '')} belongs"
        if problem:
            raise error(f"{where}: {problem}{fix}")


# ---------------------------------------------------------------------------
# checksums of tensors
# ---------------------------------------------------------------------------


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """sha256 of a tensor's name, dtype, shape and bytes (as stored: no conversion)."""
    h = hashlib.sha256()
    h.update(f"{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: tensor_digest}`` of every tensor, for a file's metadata."""
    return {k: tensor_digest(k, v) for k, v in sorted(tensors.items())}


def check_digests(tensors: Mapping[str, torch.Tensor], expected, where: str,
                  error: type[Exception] = ValueError, fix: str = "") -> None:
    """Compare ``tensors`` with the digests a file's metadata holds (``expected``: ``tensor_digests`` of what was
    written; None: a file from before fewclip wrote them, nothing to compare). A changed, missing or added
    tensor is ``error`` naming the first."""
    if expected is None:
        return
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        raise error(f"{where}: its tensor checksums (metadata 'tensors_sha256') are not a name -> sha256 map{fix}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise error(f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all){fix}")
    added = sorted(set(tensors) - set(expected))
    if added:
        raise error(f"{where}: tensor {added[0]!r} was not written with the file ({len(added)} added){fix}")
    for name in sorted(expected):
        if tensor_digest(name, tensors[name]) != expected[name]:
            raise error(f"{where}: the bytes of tensor {name!r} do not match the checksum written with the file "
                        f"(the file is damaged){fix}")
