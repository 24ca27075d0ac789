"""A device audit without a GPU: run a step on *fake* CUDA tensors and report what a GPU would pay for.

PyTorch's fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) carry a device, a shape and a
dtype but no data, so a forward pass "on ``cuda``" runs on a machine without CUDA, and every operator
still checks that its inputs share a device. ``audit`` runs a function under that mode with a dispatch
mode on top that fails on the mistakes that cost a GPU most, naming the first frame in fewclip's own code
(``fewclip/`` or ``adapters/``) that caused it:

* an operator whose inputs are on different devices (a CPU tensor meeting a CUDA one);
* a tensor (other than a 0-dim scalar) *created* on the CPU inside the step (a factory such as
  ``torch.arange`` or ``torch.tensor([...])`` without ``device=``: a host-to-device copy at every step,
  and a device mismatch as soon as it meets a CUDA tensor);
* a host sync: ``.item()``, ``float(t)``, ``.tolist()``, ``if t:`` (``aten._local_scalar_dense``), and
  ``.cpu()`` / ``.to("cpu")`` / ``.numpy()`` of a CUDA tensor.

What it cannot see: the backward pass (autograd of fake CUDA tensors needs a CUDA context), kernels
(which ones run, whether they are fast, whether a fused kernel exists), memory (peak use, fragmentation),
numerics (fake tensors have no values) and anything that depends on values (data-dependent shapes fail
here as a host sync would). Those need a GPU: ``scripts/gpu_check.py``.

``torch._subclasses.fake_tensor`` is private (and with it ``torch.utils._python_dispatch``'s mode class,
``torch.utils._pytree`` and ``torch._C._nn._parse_to``, which the audit needs around it). They are used
here, and only here, because nothing public lets a CPU-only machine run a model "on CUDA"; if a torch
release moves them, this module is the one place to change. Inside ``FakeDevice`` (only there),
``nn.Module.to`` and ``to_empty`` move parameters out of place: torch's in-place swap refuses tensors
that its fake mode holds weak references to.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (  # private: see the module docstring
    DataDependentOutputException,  # noqa: F401  (the first: for callers)
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fewclip/
_ADAPTERS = os.path.join(os.path.dirname(_PACKAGE), "adapters")  # a source checkout: adapters/ beside fewclip/
_HERE = os.path.abspath(__file__)
_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
_COPY_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.to.device,
             torch.ops.aten.to.dtype_layout}


class DeviceAuditError(AssertionError):
    """A step did something on the wrong device or synced with the host; the message names the line."""


_NOT_OURS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch, the standard library
             os.path.dirname(os.path.abspath(os.__file__)) + os.sep)


def _ours(filename: str) -> bool:
    """fewclip's code or a method's own file (not an installed library's, the standard library's or this
    module's)."""
    path = os.path.abspath(filename)
    return (path != _HERE and not path.startswith(_NOT_OURS) and not filename.startswith("<")
            and f"{os.sep}site-packages{os.sep}" not in path and f"{os.sep}dist-packages{os.sep}" not in path)


def culprit() -> str:
    """``file:line in function: code`` of the innermost frame on the stack that is not torch's (fewclip's code,
    or the file of a method registered from elsewhere)."""
    for frame in reversed(traceback.extract_stack()):
        if _ours(frame.filename):
            where = frame.filename
            for root in (_PACKAGE, _ADAPTERS):
                if os.path.abspath(where).startswith(root + os.sep):
                    where = os.path.relpath(where, os.path.dirname(root))
            return f"{where}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "(no frame outside torch)"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Watch(TorchDispatchMode):
    """Runs above ``FakeTensorMode``: sees every operator first and fails on the mistakes above."""

    def __init__(self, device: torch.device, what: str, strict: bool = True):
        super().__init__()
        self.device, self.what, self.strict = device, what, strict

    def fail(self, problem: str) -> None:
        raise DeviceAuditError(f"{self.what}: {problem} at {culprit()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if not self.strict:
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                if "device" in str(e):
                    self.fail(f"tensors on different devices ({str(e).splitlines()[0]})")
                raise
        if func in _SYNC_OPS and any(t.device == self.device for t in inputs):
            self.fail("a host sync (.item(), float(), .tolist() or a Python bool of a device tensor)")
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            if "device" in str(e):
                self.fail(f"tensors on different devices ({str(e).splitlines()[0]})")
            raise
        outputs = _tensors(out)
        on_device = any(t.device == self.device for t in inputs)
        for t in outputs:
            if t.device.type != "cpu" or t.dim() == 0:  # a 0-dim CPU tensor is a scalar argument to a kernel
                continue
            if func in _COPY_OPS and on_device:
                self.fail("a copy to the host (.cpu(), .to('cpu') or .numpy())")
            if not inputs or not any(i.device.type == "cpu" for i in inputs):
                self.fail(f"a tensor of shape {tuple(t.shape)} created on the CPU ({func})")
        return out


class _RealHost(TorchDispatchMode):
    """Runs above ``FakeTensorMode``: an operator that touches no fake tensor and asks for no other device
    runs for real, so host tensors (token ids, a CPU generator's draws, a file's tensors) keep their values
    as on a GPU machine, and only the device's tensors are fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu" or \
                any(isinstance(t, FakeTensor) for t in _tensors((args, kwargs))):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode that turns real tensors it meets into fake ones (the frozen weights a test built)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def move_module(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)`` for fake tensors: every parameter and buffer of every submodule, replaced out of
    place (torch's in-place swap refuses fake tensors, which its fake mode holds weak references to). Like
    ``Module.to``, tensors kept as plain attributes stay where they are. Call inside ``fake_mode()``."""
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None and p.device != device:
                m._parameters[k] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        for k, b in list(m._buffers.items()):
            if b is not None and b.device != device:
                m._buffers[k] = b.to(device)
    return module


def _empty_module(module: nn.Module, device: torch.device) -> nn.Module:
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[k] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = torch.empty_like(b, device=device)
    return module


@contextmanager
def _module_moves_out_of_place() -> Iterator[None]:
    """Inside the audit, ``Module.to(device)`` (build_adapter, rebuilt_for, loaders) and ``Module.to_empty``
    move through ``move_module`` (torch's in-place swap refuses tensors its fake mode holds weak references
    to, real ones included); any other ``.to`` (a dtype) is torch's own."""
    original_to, original_empty = nn.Module.to, nn.Module.to_empty

    def to(self, *args, **kwargs):
        dev, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and dev is not None:
            return move_module(self, dev)
        return original_to(self, *args, **kwargs)

    def to_empty(self, *, device, recurse: bool = True):
        return _empty_module(self, torch.device(device))

    nn.Module.to, nn.Module.to_empty = to, to_empty
    try:
        yield
    finally:
        nn.Module.to, nn.Module.to_empty = original_to, original_empty


class FakeDevice:
    """A fake CUDA device for a test: ``with FakeDevice() as dev:`` then ``dev.move(module)``,
    ``dev.tensor(t)`` and ``dev.audit(what, fn)``."""

    def __init__(self, device: str = "cuda"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.mode = fake_mode()

    def __enter__(self) -> FakeDevice:
        self._moves = _module_moves_out_of_place()
        self._moves.__enter__()
        self.mode.__enter__()
        self._host = _RealHost()
        self._host.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._host.__exit__(*exc)
        self.mode.__exit__(*exc)
        self._moves.__exit__(*exc)

    def move(self, module: nn.Module) -> nn.Module:
        return move_module(module, self.device)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def paused(self):
        """A context in which tensors are real (CPU) again, e.g. to load something whose loader reads values."""
        return unset_fake_temporarily()

    def move_attributes(self, obj: Any) -> Any:
        """Move the modules and tensors held as attributes of ``obj`` (a classifier loaded while paused)."""
        for k, v in vars(obj).items():
            if isinstance(v, nn.Module):
                self.move(v)
            elif isinstance(v, torch.Tensor):
                setattr(obj, k, v.to(self.device))
        return obj

    def audit(self, what: str, fn: Callable[[], Any], *, warmup: bool = False) -> Any:
        """``fn()`` under the watch: a ``DeviceAuditError`` naming ``what`` and the line on any mistake.
        ``warmup``: call it once before, watching only for devices that do not match, so that one-off work
        of a first call (a cache filled lazily, e.g. a teacher's text features) is not taken for the step."""
        if warmup:
            with _Watch(self.device, what, strict=False):
                fn()
        with _Watch(self.device, what):
            return fn()


def is_fake(t: Optional[torch.Tensor]) -> bool:
    return isinstance(t, FakeTensor)
