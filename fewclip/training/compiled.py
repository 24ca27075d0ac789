"""The compiled step: ``torch.compile`` of a prompt method's text side and a fused optimiser, chosen by measuring.

A prompt method runs the text tower on every class prompt at every step; that pass (``adapter.text_step``, the
name of the method that runs it: ``text_features`` for CoOp and its family and for the deep prompts,
``image_text_features`` for CoCoOp) is what ``train.compile`` compiles, with static shapes
(``dynamic=False``: the class prompts have one shape for the whole run). The optimiser step may use torch's
fused kernel (``fused=True``) where torch has one for the optimiser and the device.

``train.compile``:

* ``off``: eager, the optimiser's default implementation;
* ``on``: the text step compiled, the fused optimiser where torch offers one;
* ``auto``: measured on the run's first steps (``StepTuner``) and kept when faster. The measurement starts
  only when the rest of the run is long enough to repay a compile (its eager steps take at least
  ``COMPILE_WORTH_S``), so short runs (and the tests) train exactly as with ``off``; then the fused
  optimiser is timed against the default on copies of the parameters, and a few compiled steps against the
  eager ones. Choices are cached per device (its name, not its type), adapter class, shapes and
  precision, so a sweep measures once per setting.

Compiling changes no number beyond float rounding (the tests hold the logits to 1e-5 in fp32 on the CPU).
The measurement steps are the run's own training steps: nothing extra is drawn or trained.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fewclip.config.sections import COMPILE_MODES  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

COMPILE_WORTH_S = 60.0  # auto: compile only when the run's eager steps take at least this long
TIMED_STEPS = 3
BACKEND = "inductor"  # torch.compile's backend (a test may use "aot_eager": the same capture, no code generation)

_CHOICES: dict[tuple, bool] = {}  # (what, key...) -> measured choice, for this process


@dataclass
class StepPlan:
    """What ``prepare`` chose for one run, and why (recorded in the run's training info)."""

    compiled: bool = False
    fused: bool = False
    reasons: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"compiled_text_step": self.compiled, "fused_optimizer": self.fused, "why": list(self.reasons),
                **({"timings_s": {k: round(v, 6) for k, v in self.timings.items()}} if self.timings else {})}


def device_key(device: torch.device) -> str:
    """The device as measured: the CPU, or the GPU's name (two GPU models are two keys)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, steps: int = TIMED_STEPS) -> float:
    """Seconds per call of ``fn`` after one warm-up call (the median of ``steps``)."""
    fn()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------
# the text step
# ---------------------------------------------------------------------------


def can_compile(adapter) -> bool:
    return bool(adapter.text_step) and hasattr(torch, "compile")


def compile_text_step(adapter, backend: Optional[str] = None) -> None:
    """Replace ``adapter.<text_step>`` on this instance by its ``torch.compile``d version (static shapes),
    with ``backend`` (default ``BACKEND``)."""
    backend = backend or BACKEND
    name = adapter.text_step
    eager = getattr(type(adapter), name).__get__(adapter)
    adapter.__dict__[name] = torch.compile(eager, dynamic=False, backend=backend)
    # The compile itself happens in the next step, which can take a minute on a busy CPU: said here, and the
    # heartbeat (fewclip.utils.heartbeat) speaks while it lasts.
    log.info("%s: compiling its text step (torch.compile, backend %s); the next training step waits for it",
             getattr(adapter, "name", type(adapter).__name__), backend)


def uncompile_text_step(adapter) -> None:
    """Back to the eager method."""
    name = adapter.text_step
    if name:
        adapter.__dict__.pop(name, None)


def is_compiled(adapter) -> bool:
    name = adapter.text_step
    return bool(name) and name in adapter.__dict__


# ---------------------------------------------------------------------------
# the optimiser
# ---------------------------------------------------------------------------


def fused_supported(make: Callable[..., torch.optim.Optimizer], params: list[torch.Tensor]) -> bool:
    """Whether torch has a fused kernel for this optimiser on these parameters' device and dtype."""
    try:
        make([p.detach().clone().requires_grad_(True) for p in params[:1]], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def _time_optimizer(make, params: list[torch.Tensor], fused: bool, device: torch.device) -> float:
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for c in copies:
        c.grad = (torch.randn(c.shape, generator=gen) * 1e-3).to(c.device, c.dtype)
    opt = make(copies, fused=fused)
    return timed(opt.step, device, steps=5)


# ---------------------------------------------------------------------------
# the plan of a run
# ---------------------------------------------------------------------------


def _shape_key(adapter) -> tuple:
    return tuple((k, tuple(t.shape), str(t.dtype)) for k, t in
                 list(adapter.named_parameters()) + list(adapter.named_buffers()))


class StepTuner:
    """Chooses, while a run trains, whether its text step is compiled and its optimiser fused (module doc).

    The engine's loop calls ``start()`` before each step and ``opt = stop(opt)`` after it. With ``auto`` the
    first steps are the measurement (real training steps, timed): step 0 warms up, steps 1-3 are timed eager;
    if the rest of the run is long enough to repay a compile, the fused optimiser is timed on copies of the
    parameters (and the optimiser switched, its state carried over), the text step is compiled, step 4
    compiles, steps 5-7 are timed, and the faster is kept. A choice already measured for this device, shapes
    and precision is applied from the start. ``close()`` puts the eager text step back."""

    WARMUP, TIMED = 1, TIMED_STEPS

    def __init__(self, adapter, params: list[torch.Tensor], mode: str,
                 make_optimizer: Callable[..., torch.optim.Optimizer], total_steps: int, precision: str,
                 backend: Optional[str] = None):
        if mode not in COMPILE_MODES:
            raise ValueError(f"train.compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        self.adapter, self.params, self.mode, self.make = adapter, params, mode, make_optimizer
        self.total, self.backend = total_steps, backend
        self.device = params[0].device if params else torch.device("cpu")
        self.plan = StepPlan()
        dkey = device_key(self.device)
        self.fused_key = ("fused", dkey, type(make_optimizer(params[:1])).__name__,
                          tuple(tuple(p.shape) for p in params), str(params[0].dtype))
        self.compile_key = ("compile", dkey, type(adapter).__name__, _shape_key(adapter), precision,
                            adapter.text_mode)
        self.measuring = False
        self._step, self._t0, self._eager, self._compiled = 0, 0.0, [], []
        fused_ok = mode != "off" and fused_supported(make_optimizer, params)
        compile_ok = mode != "off" and can_compile(adapter)
        if mode == "off":
            self.plan.reasons.append("train.compile=off")
        if mode == "on":
            self.plan.fused, self.plan.compiled = fused_ok, compile_ok
            self.plan.reasons.append("train.compile=on")
        elif mode == "auto":
            if fused_ok and self.fused_key in _CHOICES:
                self.plan.fused = _CHOICES[self.fused_key]
            if compile_ok and self.compile_key in _CHOICES:
                self.plan.compiled = _CHOICES[self.compile_key]
            if self.fused_key in _CHOICES or self.compile_key in _CHOICES:
                self.plan.reasons.append(f"measured before on {dkey}")
            self.measuring = (fused_ok and self.fused_key not in _CHOICES) or \
                (compile_ok and self.compile_key not in _CHOICES)
        self._fused_ok, self._compile_ok = fused_ok, compile_ok
        if self.plan.compiled:
            compile_text_step(adapter, backend)
        self.optimizer = make_optimizer(params, fused=True) if self.plan.fused else make_optimizer(params)

    def start(self) -> None:
        if self.measuring:
            _sync(self.device)
            self._t0 = time.perf_counter()

    def stop(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.measuring:
            return opt
        _sync(self.device)
        dt = time.perf_counter() - self._t0
        i, w, n = self._step, self.WARMUP, self.TIMED
        self._step += 1
        if w <= i < w + n:
            self._eager.append(dt)
        elif w + n + 1 <= i < w + 2 * n + 1:
            self._compiled.append(dt)
        if i == w + n - 1:
            return self._decide_after_eager(opt)
        if i == w + 2 * n:
            self._decide_after_compiled()
        return opt

    def _decide_after_eager(self, opt):
        t_eager = sorted(self._eager)[len(self._eager) // 2]
        left = self.total - self._step
        if t_eager * left < COMPILE_WORTH_S:  # a short run trains as with "off", and records nothing
            self.measuring = False
            self.plan.reasons.append(f"the run's {left} remaining eager steps take {t_eager * left:.1f} s, too few to "
                                     f"repay a compile (auto measures from {COMPILE_WORTH_S:.0f} s)")
            return opt
        self.plan.timings["step_eager"] = t_eager
        dkey = self.fused_key[1]
        if self._fused_ok and self.fused_key not in _CHOICES:
            t_default = _time_optimizer(self.make, self.params, False, self.device)
            t_fused = _time_optimizer(self.make, self.params, True, self.device)
            self.plan.timings.update(optimizer_default=t_default, optimizer_fused=t_fused)
            _CHOICES[self.fused_key] = t_fused < t_default
            self.plan.reasons.append(f"fused optimiser {'faster' if t_fused < t_default else 'not faster'} on "
                                     f"{dkey} (measured)")
            if _CHOICES[self.fused_key]:
                fused = self.make(self.params, fused=True)
                fused.load_state_dict(opt.state_dict())  # momentum and step counts carry over
                opt, self.plan.fused = fused, True
        if self._compile_ok and self.compile_key not in _CHOICES:
            compile_text_step(self.adapter, self.backend)
            self.plan.compiled = True
        else:
            self.measuring = False
        return opt

    def _decide_after_compiled(self) -> None:
        self.measuring = False
        t_eager = self.plan.timings["step_eager"]
        t_compiled = sorted(self._compiled)[len(self._compiled) // 2]
        self.plan.timings["step_compiled"] = t_compiled
        faster = t_compiled < t_eager
        _CHOICES[self.compile_key] = faster
        self.plan.compiled = faster
        self.plan.reasons.append(f"compiled text step {'faster' if faster else 'not faster'} on "
                                 f"{self.compile_key[1]} (measured: {t_eager * 1e3:.2f} ms eager, "
                                 f"{t_compiled * 1e3:.2f} ms compiled per step)")
        if not faster:
            uncompile_text_step(self.adapter)

    def close(self) -> None:
        uncompile_text_step(self.adapter)

    def __enter__(self) -> StepTuner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def record(self) -> Optional[dict[str, Any]]:
        """What to record in the run's training info: None when nothing was compiled, fused or measured."""
        p = self.plan
        return p.record() if (p.compiled or p.fused or p.timings) else None


def forget_choices() -> None:
    """Drop the cached measurements (a test, or a device whose load changed)."""
    _CHOICES.clear()
