"""Linear probes on frozen image features, for every embedding geometry.

Two adapters, both fit-style (``trained_by = "fit"``): the engine calls
``fit(data)`` with the cached raw image-tower features of the un-augmented
training and validation images (``fewclip.training.engine.FitData``) instead of
running its own gradient loop.

``linear_probe``: the CLIP paper's probe
-----------------------------------------

L2-regularised multinomial logistic regression on frozen features (Radford et
al., 2021, Appendix A.3), ``logits = features @ W.T + b``. For an inverse
regularisation strength ``C`` it minimises, in float64 with full-batch L-BFGS
started from zero (deterministic)::

    mean_i CE(x_i W^T + b, y_i) + ||W||^2 / (2 C N)

which is scikit-learn's ``C * sum_i CE_i + ||W||^2 / 2`` divided by ``C N``:
the same minimiser, so ``C`` means what it means in CLIP's and CoOp's
scikit-learn probes and the usual range ``[1e-6, 1e6]`` carries over. The
intercept ``b`` is not penalised (scikit-learn's default).

``C`` is chosen on the few-shot validation split: ``grid_points`` log-spaced
values over ``[c_min, c_max]``, then ``refine_steps`` rounds of a parametric
binary search that tries the two half-way points (in log C) either side of
the best value and halves the step. The defaults (13 points, one per decade,
then 3 halvings) end at CLIP's resolution of 8 steps per decade with at
most 19 fits. Validation accuracy decides; on a tie the smaller ``C`` (stronger
regularisation) wins. ``c_min == c_max`` fixes ``C``: no search, and no
validation images needed (with a range and no validation images ``fit``
raises).

Refit: CLIP folds the validation split back into the training data for its
final classifier; CoOp's linear-probe baseline (``lpclip/linear_probe.py``)
and the few-shot papers that report its numbers keep the classifier trained on the
``shots``-per-class training set only. ``refit="train"`` (the default)
follows CoOp, so the few-shot budget is the training images and the validation
images only choose ``C``; ``refit="train+val"`` follows CLIP and refits at the
chosen ``C`` on both. ``fit`` reports the validation accuracy of the
train-only classifier at the chosen ``C`` either way.

Which features the probe sees, by geometry (``probe_features``: the
geometry's ``to_linear`` of its embedding, so the probe never asks which
geometry it has):

=============================  ===============================================
geometry                       probe features
=============================  ===============================================
clip, elliptic, sigmoid        ``embed_image(raw)``: the unit vector. These
                               geometries compare directions only, so the
                               norm carries nothing the model was trained to
                               use. (CLIP's and CoOp's reference probes feed
                               the raw, unnormalised output instead.)
euclidean, euclidean_sq        ``embed_image(raw) = raw / sqrt(D)``, not
                               normalised: distances use norms, so the norm
                               is part of what the model learned.
hyperbolic, hyperbolic_sq      ``log_map0(embed_image(raw))``, the tangent
                               vector at the hyperboloid's origin
                               (``alpha_image * raw`` up to MERU's clamps). A
                               linear classifier needs a vector space and the
                               Lorentz hyperboloid is not one; the tangent
                               space at the origin is, and it is where the
                               geometry itself averages prompt templates.
=============================  ===============================================

No further standardisation: a global rescaling of the features is absorbed by
``C`` (the search spans twelve decades), and per-dimension standardisation
would change the geometry the backbone was trained in.

``zs_probe``, the probe that starts at zero-shot, is in ``fewclip.adapters.zs_probe``.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.backbones.geometry import Geometry
from fewclip.config.presets import Preset, Setting, register_presets
from fewclip.features.encode import progress

log = logging.getLogger(__name__)

_LBFGS_TOLERANCE_CHANGE = 1e-12  # stop when the float64 objective stops moving
REFITS = ("train", "train+val")


# -----------------------------------------------------------------------------
# the geometry's linear space


def probe_features(geometry: Geometry, raw: Tensor) -> Tensor:
    """Features a linear probe sees for raw image-tower outputs: [N, D] -> [N, D] (table in the module doc)."""
    N, D = raw.shape
    return geometry.to_linear(geometry.embed_image(raw))


# -----------------------------------------------------------------------------
# logistic regression and the search over C (pure functions)


def logistic_objective(W: Tensor, b: Tensor, x: Tensor, y: Tensor, c: float) -> Tensor:
    """``mean CE(x W^T + b, y) + ||W||^2 / (2 c N)``: [K, D], [K], [N, D], [N] -> scalar."""
    N, D = x.shape
    return F.cross_entropy(x @ W.T + b, y) + W.pow(2).sum() / (2.0 * c * N)


def fit_logistic(
    x: Tensor, y: Tensor, n_classes: int, c: float, *, max_iter: int = 1000, tol: float = 1e-6
) -> tuple[Tensor, Tensor, int]:
    """Minimise ``logistic_objective`` with full-batch L-BFGS from zero.

    ``x`` [N, D] and ``y`` [N] as given (pass float64 for a tight optimum).
    Stops when the largest gradient entry is below ``tol``, the objective stops
    changing, or after ``max_iter`` iterations. The gradient is written out
    (``(softmax - onehot)^T x / N + W / (c N)``), so no autograd graph is
    built. Returns ``W`` [K, D], ``b`` [K] (centred: softmax ignores a shift
    of all biases) and the iteration count.
    """
    N, D = x.shape
    W = torch.zeros(n_classes, D, dtype=x.dtype, device=x.device)
    b = torch.zeros(n_classes, dtype=x.dtype, device=x.device)
    rows = torch.arange(N, device=x.device)
    opt = torch.optim.LBFGS(
        [W, b], lr=1.0, max_iter=max_iter, tolerance_grad=tol, tolerance_change=_LBFGS_TOLERANCE_CHANGE,
        history_size=20, line_search_fn="strong_wolfe",
    )

    @torch.no_grad()
    def closure() -> Tensor:
        logp = (x @ W.T + b).log_softmax(dim=-1)  # [N, K]
        loss = -logp[rows, y].mean() + W.pow(2).sum() / (2.0 * c * N)
        residual = logp.exp()
        residual[rows, y] -= 1.0  # softmax - onehot: [N, K]
        W.grad = residual.T @ x / N + W / (c * N)
        b.grad = residual.mean(dim=0)
        return loss

    opt.step(closure)
    n_iter = int(opt.state[W].get("n_iter", 0))
    return W, b - b.mean(), n_iter


def search_log_grid(
    score: Callable[[float], float], c_min: float, c_max: float, grid_points: int, refine_steps: int
) -> tuple[float, list[tuple[float, float]]]:
    """Maximise ``score(C)`` over ``[c_min, c_max]``: a log grid, then binary refinement.

    Grid: ``grid_points`` values evenly spaced in log C (just ``c_min`` when
    ``c_min == c_max``). Each refinement step halves the spacing and tries the
    points that far either side of the best so far (inside the range). Ties
    go to the smaller C. Returns the best C and every ``(C, score)`` tried, in
    order.
    """
    lo, hi = math.log10(c_min), math.log10(c_max)
    if lo == hi:
        logs, step = [lo], 0.0
    else:
        step = (hi - lo) / (grid_points - 1)
        logs = [lo + i * step for i in range(grid_points)]
    tried: dict[float, float] = {}
    history: list[tuple[float, float]] = []

    def value(lc: float) -> float:
        key = round(lc, 9)
        if key not in tried:
            tried[key] = float(score(10.0**lc))
            history.append((10.0**lc, tried[key]))
        return tried[key]

    def best_of(cands: Sequence[float]) -> float:
        return max(cands, key=lambda lc: (value(lc), -lc))  # ties: smaller C

    best = best_of(logs)
    for _ in range(refine_steps if step > 0 else 0):
        step /= 2
        best = best_of([lc for lc in (best - step, best, best + step) if lo - 1e-12 <= lc <= hi + 1e-12])
    return 10.0**best, history


def _top1(logits: Tensor, y: Tensor) -> float:
    """Top-1 accuracy in percent."""
    return 100.0 * float((logits.argmax(dim=-1) == y).double().mean())


def _check_data(name: str, x: Tensor, y: Tensor, n_classes: int, dim: int) -> None:
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{name}: features must be [N, {dim}], got {tuple(x.shape)}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"{name}: labels must be [{x.shape[0]}], got {tuple(y.shape)}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= n_classes):
        raise ValueError(f"{name}: labels must lie in [0, {n_classes}), got {int(y.min())}..{int(y.max())}")


def _embed_dim(backbone) -> int:
    """Width of the backbone's embedding (the text tower's output equals the image tower's; a feature backbone,
    which has no text tower, says it)."""
    return int(getattr(backbone, "feature_dim", None) or backbone.encode_text(["a"]).shape[-1])


# -----------------------------------------------------------------------------
# linear_probe


@dataclass
class LinearProbeConfig(AdapterConfig):
    name: str = field(default="linear_probe", metadata={"help": "The method (`fewclip adapters` lists them)."})
    c_min: float = field(default=1e-6, metadata={"help": (
        "Range of C (inverse L2 regularisation, scikit-learn's convention) searched on validation.")})
    c_max: float = field(default=1e6, metadata={"help": (
        "Largest inverse regularisation strength C searched (the grid runs from c_min to c_max in log space).")})
    grid_points: int = field(default=13, metadata={"help": (
        'Log-spaced starting grid over [c_min, c_max]; 13 is one point per decade.')})
    refine_steps: int = field(default=3, metadata={"help": (
        'Binary-search halvings around the best grid point; 3 ends at 8 steps per decade.')})
    max_iter: int = field(default=1000, metadata={"help": (
        'L-BFGS iterations per fit, and its stopping tolerance on the largest gradient entry.')})
    tol: float = field(default=1e-6, metadata={"help": "L-BFGS stops when the largest gradient entry is below this."})
    refit: str = field(default="train", metadata={"help": (
        'Data of the final fit at the chosen C: "train" (CoOp\'s baseline) or "train+val" (CLIP).')})

    def __post_init__(self) -> None:
        for key in ("c_min", "c_max", "tol"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"adapter.{key} must be a positive finite number, got {value!r}")
        if self.c_min > self.c_max:
            raise ValueError(f"adapter.c_min ({self.c_min}) must not exceed adapter.c_max ({self.c_max})")
        min_points = 1 if self.c_min == self.c_max else 2
        if self.grid_points < min_points:
            raise ValueError(f"adapter.grid_points must be >= {min_points} for the range "
                             f"[{self.c_min}, {self.c_max}], got {self.grid_points}")
        if self.refine_steps < 0:
            raise ValueError(f"adapter.refine_steps must be >= 0, got {self.refine_steps}")
        if self.max_iter < 1:
            raise ValueError(f"adapter.max_iter must be >= 1, got {self.max_iter}")
        if self.refit not in REFITS:
            raise ValueError(f"adapter.refit must be one of {REFITS}, got {self.refit!r}")


class LinearProbe(Adapter):
    """Multinomial logistic regression on ``probe_features``; ``C`` chosen on validation."""

    name = "linear_probe"
    trained_by = "fit"

    def __init__(self, cfg: LinearProbeConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        K, D = len(self.classnames), _embed_dim(backbone)
        self.weight = nn.Parameter(torch.zeros(K, D))
        self.bias = nn.Parameter(torch.zeros(K))

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        x = probe_features(self.backbone.geometry, features.to(self.weight.device))
        with torch.autocast(x.device.type, enabled=False):  # a half-precision argmax would blur close classes
            return F.linear(x, self.weight, self.bias)  # [B, K]

    @torch.no_grad()
    def fit(self, data) -> dict:
        """Search C on validation, keep (or refit) the classifier at the best C; returns what was chosen."""
        cfg: LinearProbeConfig = self.cfg
        K, D = self.weight.shape
        (train_x, train_y), (val_x, val_y) = data.train, data.val
        for name, x, y in (("train", train_x, train_y), ("val", val_x, val_y)):
            _check_data(f"linear_probe.fit {name}", x, y, K, D)
        if train_y.numel() == 0:
            raise ValueError("linear_probe.fit needs training images, got none")
        fixed_c = cfg.c_min == cfg.c_max
        if val_y.numel() == 0 and not fixed_c:
            raise ValueError("linear_probe chooses C on validation images, and the split has none; "
                             "set adapter.c_min = adapter.c_max to fix C instead")
        dev, g = self.weight.device, self.backbone.geometry
        xt = probe_features(g, train_x.to(dev)).double()
        xv = probe_features(g, val_x.to(dev)).double()
        yt, yv = train_y.to(dev), val_y.to(dev)
        fits: dict[float, tuple[Tensor, Tensor, int]] = {}

        def val_acc(c: float) -> float:
            fits[c] = fit_logistic(xt, yt, K, c, max_iter=cfg.max_iter, tol=cfg.tol)
            W, b, _ = fits[c]
            return _top1(xv @ W.T + b, yv) if yv.numel() else float("nan")

        with progress(desc="linear probe: C search", unit="fit", leave=False) as bar:
            def scored(c: float) -> float:
                acc = val_acc(c)
                bar.update(1)
                return acc

            best_c, history = search_log_grid(scored, cfg.c_min, cfg.c_max, cfg.grid_points, cfg.refine_steps)
        W, b, n_iter = fits[best_c]
        acc = dict(history)[best_c]
        if cfg.refit == "train+val":
            W, b, n_iter = fit_logistic(torch.cat([xt, xv]), torch.cat([yt, yv]), K, best_c,
                                        max_iter=cfg.max_iter, tol=cfg.tol)
        self.weight.copy_(W.to(self.weight.dtype))
        self.bias.copy_(b.to(self.bias.dtype))
        log.info("linear probe: C=%.3g (val top1 %.2f%%, %d fits), %d L-BFGS iterations on %s",
                 best_c, acc, len(history), n_iter, cfg.refit)
        return {
            "C": best_c,
            "val_acc": acc if yv.numel() else None,
            "iterations": n_iter,
            "converged": n_iter < cfg.max_iter,
            "refit": cfg.refit,
            "search": [[c, a] for c, a in history],
        }


register_adapter("linear_probe", LinearProbeConfig, LinearProbe, export=STATE)

register_presets(
    "linear_probe",
    Preset("authors", "CoOp's linear-probe baseline (KaiyangZhou/CoOp lpclip/linear_probe.py): fewclip's refit on "
                      "the few-shot training set", not_expressed=(
        "scikit-learn's probe on the raw, unnormalised features (CoOp lpclip/linear_probe.py); fewclip's probe sees "
        "the geometry's linear features (the unit vector for CLIP)",)),
    Preset("clip", "the CLIP paper's probe", settings=(
        Setting("adapter.refit", "train+val", "Radford et al. 2021, Appendix A.3",
                "CLIP refits the classifier on training and validation images at the chosen C"),)),
)
