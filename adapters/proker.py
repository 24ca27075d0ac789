"""ProKeR: proximal kernel ridge regression around the zero-shot classifier, in closed form.

Bendou et al., "ProKeR: A Kernel Perspective on Few-Shot Adaptation of Large Vision-Language Models", CVPR
2025; defaults from the authors' code (github.com/omarnust/BReg-Adapter @ c89ce54, the repository of the
paper's README; ``trainers/proker.py:ProKeR``, ``main.py``, ``configs/RN50/configs_proker/*.yaml``)::

    f(x) = s(x, t) + k(x, S) A,     A = (K / lambda + I)^-1 (Y - s(S, t))        # A: [N, C]
    logits(x) = scale * f(x) + bias                                            # the geometry's logits

with ``S`` the N = views x shots x C training features (every augmented view a point of its own, the authors'
``vecs``), ``Y`` their one-hot labels, ``s(x, t)`` the geometry's similarity to the zero-shot prototypes (the
authors' ``x @ clip_weights``: the cosine) and ``k`` Tip-Adapter's kernel ``exp(beta (s(x, y) - s_max))``
(the authors' ``RBF_Kernel``, ``exp(-beta (1 - cos))``). The authors' logits are ``f`` itself; fewclip's are
the geometry's logits of ``f`` (times the logit scale, plus SigLIP's bias): the same argmax and the same
searched choices, and as lambda -> 0 (A = 0, also before fit) exactly the zero-shot logits in every geometry.

beta and lambda are searched on validation over ``linspace`` grids (the authors' per-dataset yaml; the default
is the most common one, ``beta: [0.5, 3, 20]``, ``lmbda: [0.001, 1, 10]`` of Caltech101, FGVC, Food101 and
UCF101). For one beta the kernel is computed once and each lambda solved by Cholesky (the authors'
``torch.linalg.solve`` per pair is LU; the same solution in float64).

At scale (``solver``): the kernel has N^2 entries (ImageNet, 16 shots, 10 views: N = 160000, 205 GB in
float64), which is where the authors stop (no SUN397 at 16 shots). Above ``direct_max`` training points
fewclip solves the same system by conjugate gradients on all C right-hand sides at once, with the kernel
computed ``chunk`` rows at a time and never stored: memory O(N C + chunk N). ``solver=direct`` /
``solver=cg`` force one; both give the same A to the solver's tolerance (tested).

Where fewclip differs, and why:

* The search runs on fewclip's **few-shot validation split** (the authors' default ``--hp-selection
  tip-adapter`` uses the dataset's whole validation split; ``imagenet`` transfers ImageNet's tuned values).
* Ties of validation accuracy go to the lowest validation cross-entropy of the logits; ``tie_break=first`` is
  the authors' first maximum (beta-major, strict ``>``).
* float64 throughout (the authors' float32 kernel and solve).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fewclip.geometry import Geometry

from ._cache import TIE_BREAKS, affinity, choose, self_similarity, scored, text_classifier
from fewclip.state_export import STATE
from fewclip.adapter import Adapter, AdapterConfig, register_adapter
from fewclip.presets import Preset, Setting, register_presets

log = logging.getLogger(__name__)

SOLVERS = ("auto", "direct", "cg")


@dataclass
class ProKeRConfig(AdapterConfig):
    name: str = "proker"
    views: int = field(default=10, metadata={"help": "augmented views of each training image, each a training "
                                                     "point (the authors' --augment-epoch)"})
    beta_grid: List[float] = field(default_factory=lambda: [0.5, 3.0, 20],
                                   metadata={"help": "[start, stop, steps] of the beta linspace searched"})
    lmbda_grid: List[float] = field(default_factory=lambda: [0.001, 1.0, 10],
                                    metadata={"help": "[start, stop, steps] of the lambda linspace searched"})
    init_beta: float = field(default=1.7, metadata={"help": "beta without a search (ImageNet 16 shots, the "
                                                            "authors' hyperparameters.json)"})
    init_lmbda: float = field(default=0.1, metadata={"help": "lambda without a search (ImageNet 16 shots)"})
    search: bool = field(default=True, metadata={"help": "search beta and lambda on the few-shot validation split"})
    tie_break: str = field(default="loss", metadata={"help": "among equal validation accuracies: 'loss' or 'first' "
                                                             "(the authors')"})
    solver: str = field(default="auto", metadata={"help": "'direct' (the N x N kernel), 'cg' (conjugate gradients, "
                                                          "kernel never stored) or 'auto' (cg above direct_max)"})
    direct_max: int = field(default=20000, metadata={"help": "largest N solved directly under solver=auto"})
    chunk: int = field(default=1024, metadata={"help": "kernel rows computed at a time by the cg solver"})
    cg_tol: float = field(default=1e-8, metadata={"help": "relative residual at which cg stops (per class)"})
    cg_max_iter: int = field(default=2000, metadata={"help": "most cg iterations"})

    def __post_init__(self) -> None:
        if self.views < 0:
            raise ValueError(f"adapter.views must be >= 0 (0: the un-augmented features), got {self.views}")
        for key in ("beta_grid", "lmbda_grid"):
            g = list(getattr(self, key))
            if len(g) != 3 or not 0 < g[0] <= g[1] or int(g[2]) != g[2] or g[2] < 1:
                raise ValueError(f"adapter.{key} must be [start, stop, steps] with 0 < start <= stop and an "
                                 f"integer steps >= 1, got {g}")
        for key in ("init_beta", "init_lmbda", "cg_tol"):
            if not getattr(self, key) > 0:
                raise ValueError(f"adapter.{key} must be > 0, got {getattr(self, key)}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"adapter.tie_break must be one of {', '.join(TIE_BREAKS)}, got {self.tie_break!r}")
        if self.solver not in SOLVERS:
            raise ValueError(f"adapter.solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}")
        for key in ("direct_max", "chunk", "cg_max_iter"):
            if getattr(self, key) < 1:
                raise ValueError(f"adapter.{key} must be >= 1, got {getattr(self, key)}")


def grid(spec: Sequence[float]) -> List[float]:
    """The authors' ``torch.linspace(start, stop, steps)`` (float32, as theirs), as floats."""
    return [float(v) for v in torch.linspace(float(spec[0]), float(spec[1]), int(spec[2]))]


def kernel(geometry: Geometry, x: Tensor, keys: Tensor, beta: float, s_max: float) -> Tensor:
    """ProKeR's kernel of embedded points x [B, D] and keys [N, D] -> [B, N]: ``exp(beta (s(x, k) - s_max))``
    (``_cache.affinity``, computed in place where no gradient is asked: one [B, N] array at a time)."""
    if torch.is_grad_enabled():
        return affinity(geometry, x, keys, beta, s_max)
    return geometry.similarity(x, keys).sub_(s_max).mul_(beta).exp_()


@torch.no_grad()
def solve_direct(K: Tensor, R: Tensor, lmbda: float) -> Tensor:
    """A = (K / lambda + I)^-1 R for a kernel K [N, N] and targets R [N, C] (the authors' closed form)."""
    N, C = R.shape
    system = K / lmbda
    system.diagonal().add_(1.0)  # K / lambda + I: symmetric positive definite, so Cholesky (half LU's work)
    factor, info = torch.linalg.cholesky_ex(system)
    if int(info) == 0:
        return torch.cholesky_solve(R, factor)
    return torch.linalg.solve(system, R)  # not numerically positive definite (a kernel that is not PSD in float)


@torch.no_grad()
def solve_cg(geometry: Geometry, keys: Tensor, R: Tensor, beta: float, lmbda: float, s_max: float, *,
             chunk: int = 1024, tol: float = 1e-8, max_iter: int = 2000) -> Tuple[Tensor, int]:
    """The same A by conjugate gradients on every column of R [N, C] at once, the kernel of ``keys`` [N, D]
    computed ``chunk`` rows at a time and never stored (memory O(N C + chunk N)). Returns (A, iterations)."""
    N, C = R.shape

    def apply(P: Tensor) -> Tensor:  # (K / lambda + I) P, [N, C] -> [N, C]
        out = P.clone()
        for i in range(0, N, chunk):
            Ki = kernel(geometry, keys[i : i + chunk], keys, beta, s_max).to(P.dtype)  # [chunk, N]
            out[i : i + chunk] += (Ki @ P) / lmbda
        return out

    X = torch.zeros_like(R)
    Res = R.clone()
    P = Res.clone()
    rr = (Res * Res).sum(0)  # [C]
    stop = (tol ** 2) * rr.clamp_min(1e-300)
    it = 0
    while it < max_iter and bool((rr > stop).any()):
        AP = apply(P)
        step = rr / (P * AP).sum(0).clamp_min(1e-300)  # [C]
        X.addcmul_(P, step)  # in place: five N x C arrays in all (R, X, Res, P, AP)
        Res.addcmul_(AP, -step)
        del AP
        rr_new = (Res * Res).sum(0)
        P.mul_(rr_new / rr.clamp_min(1e-300)).add_(Res)
        rr = rr_new
        it += 1
    if bool((rr > stop).any()):
        log.warning("proker: conjugate gradients stopped at %d iterations, relative residual %.2g > %.2g", it,
                    float((rr / stop).max().sqrt()) * tol, tol)
    return X, it


class ProKeR(Adapter):
    """Zero-shot similarities plus a kernel ridge regression of their residuals on the training images."""

    name = "proker"
    trained_by = "fit"

    def __init__(self, cfg: ProKeRConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes
        C, D = protos.shape
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        # on the device, read without a host sync (a Python float would be read back from the GPU at every build)
        self.register_buffer("s_max", self_similarity(backbone.geometry, D), persistent=False)
        # What fit() finds is saved: the training points and their coefficients (none until fit: zero-shot).
        self.register_buffer("beta", torch.tensor(float(cfg.init_beta)))
        self.register_buffer("lmbda", torch.tensor(float(cfg.init_lmbda)))
        self.register_buffer("keys", torch.zeros(0, D))
        self.register_buffer("coef", torch.zeros(0, C))

    def load_adapter_state_dict(self, sd: Dict[str, Tensor]) -> None:
        """Load a saved state whatever its number of training points."""
        if "keys" in sd and "coef" in sd:
            self.keys = torch.empty_like(sd["keys"], device=self.keys.device)
            self.coef = torch.empty_like(sd["coef"], device=self.coef.device)
        super().load_adapter_state_dict(sd)

    def regression(self, img: Tensor) -> Tensor:
        """f(x) - s(x, t) = k(x, S) A of embedded images [B, D] -> [B, C], in ``chunk``-row pieces of S."""
        B, D = img.shape
        out = img.new_zeros(B, self.coef.shape[1])
        beta = self.beta.to(img.dtype)  # a 0-dim tensor on the device: no host read per call
        for i in range(0, self.keys.shape[0], self.cfg.chunk):
            Ki = kernel(self.backbone.geometry, img, self.keys[i : i + self.cfg.chunk].to(img.dtype), beta, self.s_max)
            out += Ki @ self.coef[i : i + self.cfg.chunk].to(img.dtype)
        return out

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        g = self.backbone.geometry
        img = g.embed_image(features.to(self.prototypes.device))
        zs = g.logits(img, self.prototypes.to(img.dtype))  # scale * s(x, t) + bias
        if self.keys.shape[0] == 0:
            return zs
        return zs + g.scale.to(img.dtype) * self.regression(img)

    def fit_views(self) -> int:
        return self.cfg.views

    # -- the closed form ------------------------------------------------------
    def targets(self, keys: Tensor, labels: Tensor) -> Tensor:
        """Y - s(S, t): one-hot labels minus the zero-shot similarities of the embedded training points [N, C]."""
        C = len(self.classnames)
        s0 = self.backbone.geometry.similarity(keys, self.prototypes.to(keys.dtype))
        return F.one_hot(labels.to(keys.device), C).to(keys.dtype) - s0

    def use_cg(self, n: int) -> bool:
        return self.cfg.solver == "cg" or (self.cfg.solver == "auto" and n > self.cfg.direct_max)

    @torch.no_grad()
    def solve(self, keys: Tensor, R: Tensor, beta: float, lmbda: float) -> Tensor:
        """A for one (beta, lambda) with the configured solver."""
        cfg: ProKeRConfig = self.cfg
        if self.use_cg(keys.shape[0]):
            A, it = solve_cg(self.backbone.geometry, keys, R, beta, lmbda, self.s_max, chunk=cfg.chunk,
                             tol=cfg.cg_tol, max_iter=cfg.cg_max_iter)
            log.info("proker: cg solved N=%d, C=%d in %d iterations", keys.shape[0], R.shape[1], it)
            return A
        return solve_direct(kernel(self.backbone.geometry, keys, keys, beta, self.s_max), R, lmbda)

    @torch.no_grad()
    def fit(self, data) -> Dict:
        """The training points (every view), beta and lambda searched on validation, then A."""
        cfg: ProKeRConfig = self.cfg
        g = self.backbone.geometry
        views = data.views[: cfg.views] if cfg.views else [data.train]
        dev = self.prototypes.device
        keys = g.embed_image(torch.cat([v.x for v in views]).to(dev).double())  # [N, D]
        y = torch.cat([v.y for v in views]).to(dev)
        R = self.targets(keys, y)
        found = self.search(keys, R, data.val)
        A = self.solve(keys, R, found["beta"], found["lmbda"])
        self.beta.fill_(found["beta"])
        self.lmbda.fill_(found["lmbda"])
        self.keys = keys.to(self.keys.dtype).contiguous()  # as it is saved and loaded: the same sums
        self.coef = A.to(self.coef.dtype).contiguous()
        return {**found, "n_train_points": int(keys.shape[0]), "solver": "cg" if self.use_cg(len(keys)) else "direct"}

    @torch.no_grad()
    def search(self, keys: Tensor, R: Tensor, val) -> Dict:
        """(beta, lambda) with the best validation accuracy over the grids (ties: ``tie_break``)."""
        cfg: ProKeRConfig = self.cfg
        vx, vy = val
        if not cfg.search or vy.numel() == 0:
            if cfg.search:
                log.warning("proker: no validation images; keeping beta=%g, lambda=%g", cfg.init_beta, cfg.init_lmbda)
            return {"beta": float(cfg.init_beta), "lmbda": float(cfg.init_lmbda), "searched": False}
        g = self.backbone.geometry
        img = g.embed_image(vx.to(keys.device).to(keys.dtype))
        scale, zs = g.scale.to(img.dtype), g.logits(img, self.prototypes.to(img.dtype))
        betas, lmbdas = grid(cfg.beta_grid), grid(cfg.lmbda_grid)
        cands, accs, losses = [], [], []
        for beta in betas:
            Kx = kernel(g, img, keys, beta, self.s_max)  # [B, N]
            if self.use_cg(keys.shape[0]):
                solutions = (self.solve(keys, R, beta, lm) for lm in lmbdas)
            else:  # one kernel for every lambda
                K = kernel(g, keys, keys, beta, self.s_max)
                solutions = (solve_direct(K, R, lm) for lm in lmbdas)
            for lm, A in zip(lmbdas, solutions):
                acc, ce = scored(zs + scale * (Kx @ A), vy)
                cands.append((beta, lm))
                accs.append(acc)
                losses.append(ce)
        i = choose(accs, losses, cfg.tie_break)
        zs_acc = scored(zs, vy)[0]
        log.info("proker: beta=%.4g lambda=%.4g (val top1 %.2f%%, zero-shot %.2f%%)", *cands[i], accs[i], zs_acc)
        return {"beta": cands[i][0], "lmbda": cands[i][1], "searched": True, "val_acc": accs[i],
                "zeroshot_val_acc": zs_acc, "val_ties": sum(a == accs[i] for a in accs), "val_accs": accs}


register_adapter("proker", ProKeRConfig, ProKeR, export=STATE)

register_presets(
    "proker",
    Preset("authors", "ProKeR's released code (trainers/proker.py, configs/RN50/configs_proker/*.yaml)", settings=(
        Setting("adapter.tie_break", "first", "omarnust/BReg-Adapter@c89ce54 trainers/proker.py:48",
                "their search keeps the first best (beta, lambda) (strict >); fewclip the lowest validation loss"),),
        not_expressed=("per-dataset grids (omarnust/BReg-Adapter@c89ce54 configs/RN50/configs_proker/<dataset>.yaml): "
                       "set adapter.beta_grid and adapter.lmbda_grid",
                       "float32 kernel and solve (trainers/proker.py:44); fewclip float64")),
)
