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
float64), which is where the authors stop (no SUN397 at 16 shots). Above ``direct_max`` training points fewclip
solves the same system by conjugate gradients on all C right-hand sides at once (``solve_cg``), the kernel never
stored: ``KernelOperator`` computes it in ``cg_block``-sized tiles, each tile above the diagonal used for its rows
and its columns (K is symmetric), in float32 (the authors' precision; ``cg_dtype=auto`` checks on a sample that
the geometry's kernel is exact to 1e-6 in float32, else float64: the elliptic geometry's arccos is not) summed
over tiles in float64; a rank-
``cg_rank`` Nystrom preconditioner takes K's largest eigenvalues out of the iteration (about 3x fewer iterations
on 100 classes); each lambda of the search starts from the previous lambda's solution, and the searched solution
is kept rather than solved again. Memory O(N C + N cg_rank + cg_block^2). cg stops at a relative residual of
``cg_tol`` (1e-6), which bounds the error of the fitted training values by the same fraction; the solution
equals the direct one to that tolerance (tested at 1e-5 in float32 and 1e-8 in float64). ``solver=direct`` /
``solver=cg`` force one.

Where fewclip differs, and why:

* The search runs on fewclip's **few-shot validation split** (the authors' default ``--hp-selection
  tip-adapter`` uses the dataset's whole validation split; ``imagenet`` transfers ImageNet's tuned values).
* Ties of validation accuracy go to the lowest validation cross-entropy of the logits; ``tie_break=first`` is
  the authors' first maximum (beta-major, strict ``>``).
* float64 throughout (the authors' float32 kernel and solve), except cg's float32 kernel tiles where they are
  exact to 1e-6 (``cg_dtype=float64`` for float64 there too).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import TIE_BREAKS, affinity, choose, scored, self_similarity, text_classifier
from fewclip.backbones.geometry import Geometry
from fewclip.config.presets import Preset, Setting, register_presets

log = logging.getLogger(__name__)

SOLVERS = ("auto", "direct", "cg")
CG_DTYPES = {"float32": torch.float32, "float64": torch.float64}
FLOAT32_KERNEL_TOL = 1e-6  # largest difference of float32 kernel entries (at most 1) from float64 ones for "auto"


@dataclass
class ProKeRConfig(AdapterConfig):
    name: str = field(default="proker", metadata={"help": "The method (`fewclip adapters` lists them)."})
    views: int = field(default=10, metadata={"help": "augmented views of each training image, each a training "
                                                     "point (the authors' --augment-epoch)"})
    beta_grid: list[float] = field(default_factory=lambda: [0.5, 3.0, 20],
                                   metadata={"help": "[start, stop, steps] of the beta linspace searched"})
    lmbda_grid: list[float] = field(default_factory=lambda: [0.001, 1.0, 10],
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
    chunk: int = field(default=1024, metadata={"help": "training points scored at a time at prediction"})
    cg_block: int = field(default=4096, metadata={"help": "side of the kernel tiles the cg solver computes at a time"})
    cg_dtype: str = field(default="auto", metadata={"help": "precision of the cg solver's kernel tiles and their "
                                                            "products, summed in float64: 'float32', 'float64' or "
                                                            "'auto' (float32 where the geometry's kernel is exact to "
                                                            "1e-6 in it: not an angle's arccos near 0)"})
    cg_rank: int = field(default=1000, metadata={"help": "rank of the cg solver's Nystrom preconditioner (0: none)"})
    cg_tol: float = field(default=1e-6, metadata={"help": "relative residual at which cg stops (per class); float32 "
                                                          "tiles reach about 1e-7"})
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
        if self.cg_dtype not in ("auto", *CG_DTYPES):
            raise ValueError(f"adapter.cg_dtype must be auto, float32 or float64, got {self.cg_dtype!r}")
        if self.cg_rank < 0:
            raise ValueError(f"adapter.cg_rank must be >= 0 (0: no preconditioner), got {self.cg_rank}")
        for key in ("direct_max", "chunk", "cg_block", "cg_max_iter"):
            if getattr(self, key) < 1:
                raise ValueError(f"adapter.{key} must be >= 1, got {getattr(self, key)}")


def grid(spec: Sequence[float]) -> list[float]:
    """The authors' ``torch.linspace(start, stop, steps)`` (float32, as theirs), as floats."""
    return [float(v) for v in torch.linspace(float(spec[0]), float(spec[1]), int(spec[2]))]


def kernel(geometry: Geometry, x: Tensor, keys: Tensor, beta: float, s_max: float) -> Tensor:
    """ProKeR's kernel of embedded points x [B, D] and keys [N, D] -> [B, N]: ``exp(beta (s(x, k) - s_max))``
    (``_cache.affinity``, computed in place where no gradient is asked: one [B, N] array at a time)."""
    if torch.is_grad_enabled():
        return affinity(geometry, x, keys, beta, s_max)
    return geometry.similarity(x, keys).sub_(s_max).mul_(beta).exp_()


@torch.no_grad()
def kernel_times(geometry: Geometry, x: Tensor, keys: Tensor, A: Tensor, beta: float, s_max, chunk: int) -> Tensor:
    """k(x, S) A of points x [B, D], keys [N, D] and coefficients A [N, C] -> [B, C], ``chunk`` keys at a time: never
    the whole [B, N] kernel (ImageNet's validation against 160000 points would be 5 GB in float64)."""
    out = x.new_zeros(x.shape[0], A.shape[1])
    for i in range(0, keys.shape[0], chunk):
        out += kernel(geometry, x, keys[i : i + chunk], beta, s_max) @ A[i : i + chunk]
    return out


@torch.no_grad()
def tile_dtype(geometry: Geometry, keys: Tensor, beta: float, s_max, sample: int = 256) -> torch.dtype:
    """float32 where the kernel of ``sample`` of the training points [N, D] (the diagonal included) computed in
    float32 is within ``FLOAT32_KERNEL_TOL`` of float64, else float64. The cosine's kernel is (about 1e-7); an
    angle's (the elliptic geometry: arccos near 1, whose slope is infinite) is not (about 1e-3)."""
    n = keys.shape[0]
    x = keys[torch.linspace(0, n - 1, min(sample, n), device=keys.device).round().long().unique()]
    exact = kernel(geometry, x.double(), x.double(), beta, s_max)
    single = kernel(geometry, x.float(), x.float(), beta, s_max).double()
    return torch.float32 if float((single - exact).abs().max()) <= FLOAT32_KERNEL_TOL else torch.float64


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


class KernelOperator:
    """``v -> K v`` for the kernel of ``keys`` [N, D], in ``block`` x ``block`` tiles computed as they are needed
    and never stored (memory O(block^2) beyond the vectors).

    Each tile is one similarity matmul, an in-place ``exp`` and two matmuls: ``K`` is symmetric, so a tile
    above the diagonal serves both its rows and (transposed) its columns, and every kernel entry is computed
    once per product. Tiles and their products are in ``dtype`` (float32: the authors' precision, three times
    faster than float64 here), summed over the tiles in float64. ``max_tiles`` stops a product after that many
    tiles (a wrong product: only for timing a part of one, ``scripts/bench_proker.py``)."""

    def __init__(self, geometry: Geometry, keys: Tensor, beta: float, s_max, *, block: int = 4096,
                 dtype: torch.dtype = torch.float32, max_tiles: Optional[int] = None):
        self.geometry, self.beta, self.s_max = geometry, float(beta), s_max
        self.keys = keys.to(dtype).contiguous()  # [N, D]
        self.block, self.dtype, self.max_tiles = int(block), dtype, max_tiles
        self.products = 0  # how many times the operator was applied (a product costs N^2 (D / 2 + C) multiply-adds)
        self.tiles = 0  # tiles computed

    @property
    def n_tiles(self) -> int:
        """Tiles in one product: the blocks on and above the diagonal."""
        n = -(-self.keys.shape[0] // self.block)
        return n * (n + 1) // 2

    def tile(self, i: int, j: int) -> Tensor:
        """The kernel's rows i:i+block, columns j:j+block."""
        b = self.block
        return kernel(self.geometry, self.keys[i : i + b], self.keys[j : j + b], self.beta, self.s_max)

    @torch.no_grad()
    def __call__(self, P: Tensor) -> Tensor:  # [N, C] -> [N, C], in P's dtype
        N, b = self.keys.shape[0], self.block
        Pd = P.to(self.dtype)
        KP = torch.zeros_like(P, dtype=torch.float64)
        done = 0
        for i in range(0, N, b):
            for j in range(i, N, b):
                if self.max_tiles is not None and done >= self.max_tiles:
                    break
                done += 1
                Kij = self.tile(i, j)  # [bi, bj]
                KP[i : i + b] += Kij @ Pd[j : j + b]
                if j != i:
                    KP[j : j + b] += Kij.T @ Pd[i : i + b]
                del Kij
        self.products += 1
        self.tiles += done
        return KP  # float64

    @torch.no_grad()
    def columns(self, idx: Tensor) -> Tensor:
        """The kernel's columns ``idx`` [N, r] in float64 (for the Nystrom preconditioner)."""
        N, b = self.keys.shape[0], self.block
        landmarks = self.keys[idx]
        return torch.cat([kernel(self.geometry, self.keys[i : i + b], landmarks, self.beta, self.s_max).double()
                          for i in range(0, N, b)])


class NystromPreconditioner:
    """``(K / lambda + I)^-1`` approximated through a rank-r Nystrom approximation of K from r landmark columns
    (evenly spaced training points): ``K ~ U diag(s) U^T`` and (Frangella, Tropp and Udell, "Randomized Nystrom
    preconditioning", SIAM J. Matrix Anal. Appl. 2023)::

        P^-1 v = U diag((s_r + lambda) / (s + lambda)) U^T v + (v - U U^T v)

    so the r largest eigenvalues of K, which set the condition number (K's top eigenvalues grow with N; the
    system's smallest is 1), are taken out of the iteration. Memory: U [N, r] in float64."""

    def __init__(self, op: KernelOperator, rank: int):
        N = op.keys.shape[0]
        idx = torch.linspace(0, N - 1, min(int(rank), N), device=op.keys.device).round().long().unique()
        Cn = op.columns(idx)  # [N, r]
        W = Cn[idx]  # [r, r]
        shift = 1e-10 * float(W.diagonal().sum()) + 1e-12  # jitter: W is positive semi-definite up to rounding
        L, info = torch.linalg.cholesky_ex(W + shift * torch.eye(len(idx), dtype=W.dtype, device=W.device))
        if int(info):
            ev, V = torch.linalg.eigh(W)
            keep = ev > ev.max() * 1e-10
            B = Cn @ (V[:, keep] / ev[keep].sqrt())  # [N, r']
        else:
            B = torch.linalg.solve_triangular(L, Cn.T, upper=False).T  # C L^-T: K ~ B B^T
        del Cn
        s, V = torch.linalg.eigh(B.T @ B)  # B = U diag(sqrt(s)) V^T through the r x r Gram matrix (no N x r copy)
        keep = s > s.max() * 1e-12
        s, V = s[keep].flip(0), V[:, keep].flip(1)  # descending
        self.U = (B @ V).div_(s.sqrt())  # [N, r], orthonormal columns
        del B
        self.s = s  # [r] the approximation's eigenvalues; independent of lambda: one per beta

    def apply(self, R: Tensor, lmbda: float) -> Tensor:  # [N, C] -> [N, C]
        shrink = ((self.s[-1] + lmbda) / (self.s + lmbda) - 1.0).unsqueeze(1)  # [r, 1]
        return (self.U @ ((self.U.T @ R) * shrink)).add_(R)  # one [N, C] array made


@torch.no_grad()
def solve_cg(geometry: Geometry, keys: Tensor, R: Tensor, beta: float, lmbda: float, s_max, *,
             block: int = 4096, tol: float = 1e-8, max_iter: int = 2000, dtype: torch.dtype = torch.float64,
             rank: int = 0, precond: Optional[NystromPreconditioner] = None, x0: Optional[Tensor] = None,
             operator: Optional[KernelOperator] = None,
             stats: Optional[dict] = None, callback: Optional[Callable[[int, float], None]] = None) -> tuple[Tensor, int]:
    """The same A = (K / lambda + I)^-1 R by (preconditioned) conjugate gradients on every column of R [N, C] at
    once, the kernel of ``keys`` [N, D] computed in ``block``-sized tiles and never stored (``KernelOperator``:
    memory O(N C + block^2)). ``rank`` > 0: Nystrom preconditioner of that rank (or ``precond``, one made for
    the same keys and beta, reused across lambdas; ``operator``: the kernel's, likewise); ``x0``: the start (default 0,
    the zero-shot classifier). Stops when every column's residual is below ``tol`` times its right-hand side's
    (the fitted training values are then within that of the exact ones: ``||K e / lambda|| <= ||residual||``).
    Returns (A, iterations); ``stats`` (a dict) receives the operator's products and the preconditioner's rank;
    ``callback(iteration, largest relative residual)`` is called after each iteration (progress, benchmarks)."""
    N, C = R.shape
    op = operator or KernelOperator(geometry, keys, beta, s_max, block=block, dtype=dtype)
    if precond is None and rank > 0:
        precond = NystromPreconditioner(op, rank)

    products, tiles = op.products, op.tiles

    def system(V: Tensor) -> Tensor:  # (K / lambda + I) V
        return op(V).div_(lmbda).to(V.dtype).add_(V)
    M = (lambda V: precond.apply(V, lmbda)) if precond is not None else (lambda V: V)  # noqa: E731
    if x0 is None:
        X, Res = torch.zeros_like(R), R.clone()
    else:  # x0 scaled per column to the smallest residual: never a worse start than zero (for one product)
        X = x0.to(R.dtype).clone()
        MX = system(X)
        scale = (R * MX).sum(0) / (MX * MX).sum(0).clamp_min(1e-300)  # [C]
        X.mul_(scale)
        Res = R - MX.mul_(scale)
        del MX
    Z = M(Res)
    P = Z.clone()
    rz = (Res * Z).sum(0)  # [C]
    stop = (tol ** 2) * (R * R).sum(0).clamp_min(1e-300)
    rr = (Res * Res).sum(0)
    it = 0
    while it < max_iter and bool((rr > stop).any()):
        AP = system(P)
        step = rz / (P * AP).sum(0).clamp_min(1e-300)  # [C]
        X.addcmul_(P, step)  # in place: R, X, Res, P, AP (and Z with a preconditioner), each N x C
        Res.addcmul_(AP, -step)
        del AP
        rr = (Res * Res).sum(0)
        Z = M(Res)
        rz_new = (Res * Z).sum(0)
        P.mul_(rz_new / rz.clamp_min(1e-300)).add_(Z)
        rz = rz_new
        it += 1
        if callback is not None:
            callback(it, float((rr / (R * R).sum(0).clamp_min(1e-300)).max().sqrt()))
    if bool((rr > stop).any()):
        log.warning("proker: conjugate gradients stopped at %d iterations, relative residual %.2g > %.2g", it,
                    float((rr / stop).max().sqrt()) * tol, tol)
    if stats is not None:
        stats.update(products=op.products - products, tiles=op.tiles - tiles, rank=0 if precond is None else int(precond.s.numel()),
                     residual=float((rr / (R * R).sum(0).clamp_min(1e-300)).max().sqrt()))
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

    def load_adapter_state_dict(self, sd: dict[str, Tensor]) -> None:
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

    def cg_dtype(self, keys: Tensor, beta: float) -> torch.dtype:
        """The precision of cg's kernel tiles (``adapter.cg_dtype``; auto: ``tile_dtype``)."""
        if self.cfg.cg_dtype != "auto":
            return CG_DTYPES[self.cfg.cg_dtype]
        return tile_dtype(self.backbone.geometry, keys, beta, self.s_max)

    def use_cg(self, n: int) -> bool:
        return self.cfg.solver == "cg" or (self.cfg.solver == "auto" and n > self.cfg.direct_max)

    @torch.no_grad()
    def solve(self, keys: Tensor, R: Tensor, beta: float, lmbda: float, *, x0: Optional[Tensor] = None,
              precond: Optional[NystromPreconditioner] = None, operator: Optional[KernelOperator] = None) -> Tensor:
        """A for one (beta, lambda) with the configured solver (cg: from ``x0``, default 0, the zero-shot
        classifier; ``precond`` one for the same keys and beta)."""
        cfg: ProKeRConfig = self.cfg
        if self.use_cg(keys.shape[0]):
            A, it = solve_cg(self.backbone.geometry, keys, R, beta, lmbda, self.s_max, block=cfg.cg_block,
                             tol=cfg.cg_tol, max_iter=cfg.cg_max_iter, dtype=self.cg_dtype(keys, beta),
                             rank=cfg.cg_rank, precond=precond, x0=x0, operator=operator)
            log.info("proker: cg solved N=%d, C=%d in %d iterations", keys.shape[0], R.shape[1], it)
            return A
        return solve_direct(kernel(self.backbone.geometry, keys, keys, beta, self.s_max), R, lmbda)

    def solve_path(self, keys: Tensor, R: Tensor, beta: float, lmbdas: Sequence[float]):
        """cg's A for each lambda of one beta in turn: one preconditioner for them all, each solve started from
        the previous lambda's A (a neighbour on the grid) instead of zero."""
        cfg: ProKeRConfig = self.cfg
        op = KernelOperator(self.backbone.geometry, keys, beta, self.s_max, block=cfg.cg_block,
                            dtype=self.cg_dtype(keys, beta))
        precond = NystromPreconditioner(op, cfg.cg_rank) if cfg.cg_rank > 0 else None
        A = None
        for lm in lmbdas:
            A = self.solve(keys, R, beta, lm, x0=A, precond=precond, operator=op)
            yield A

    @torch.no_grad()
    def fit(self, data) -> dict:
        """The training points (every view), beta and lambda searched on validation, then A."""
        cfg: ProKeRConfig = self.cfg
        g = self.backbone.geometry
        views = data.views[: cfg.views] if cfg.views else [data.train]
        dev = self.prototypes.device
        keys = g.embed_image(torch.cat([v.x for v in views]).to(dev).double())  # [N, D]
        y = torch.cat([v.y for v in views]).to(dev)
        R = self.targets(keys, y)
        found = self.search(keys, R, data.val)
        A = found.pop("A", None)  # the searched solution (cg's is not computed a second time)
        if A is None:
            A = self.solve(keys, R, found["beta"], found["lmbda"])
        self.beta.fill_(found["beta"])
        self.lmbda.fill_(found["lmbda"])
        self.keys = keys.to(self.keys.dtype).contiguous()  # as it is saved and loaded: the same sums
        self.coef = A.to(self.coef.dtype).contiguous()
        return {**found, "n_train_points": int(keys.shape[0]), "solver": "cg" if self.use_cg(len(keys)) else "direct"}

    @torch.no_grad()
    def search(self, keys: Tensor, R: Tensor, val) -> dict:
        """(beta, lambda) with the best validation accuracy over the grids (ties: ``tie_break``), and its ``A``."""
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
        cands, accs, losses, best = [], [], [], None
        for beta in betas:
            if self.use_cg(keys.shape[0]):
                solutions = self.solve_path(keys, R, beta, lmbdas)
                Kx = None  # the validation kernel [B, N] too is computed in pieces (kernel_times)
            else:  # one kernel for every lambda
                K = kernel(g, keys, keys, beta, self.s_max)
                solutions = (solve_direct(K, R, lm) for lm in lmbdas)
                Kx = kernel(g, img, keys, beta, self.s_max)  # [B, N]
            for lm, A in zip(lmbdas, solutions):
                fitted = Kx @ A if Kx is not None else kernel_times(g, img, keys, A, beta, self.s_max, cfg.chunk)
                acc, ce = scored(zs + scale * fitted, vy)
                cands.append((beta, lm))
                accs.append(acc)
                losses.append(ce)
                if choose(accs, losses, cfg.tie_break) == len(accs) - 1:  # the best so far: kept
                    best = A
        i = choose(accs, losses, cfg.tie_break)
        zs_acc = scored(zs, vy)[0]
        log.info("proker: beta=%.4g lambda=%.4g (val top1 %.2f%%, zero-shot %.2f%%)", *cands[i], accs[i], zs_acc)
        return {"beta": cands[i][0], "lmbda": cands[i][1], "searched": True, "val_acc": accs[i],
                "zeroshot_val_acc": zs_acc, "val_ties": sum(a == accs[i] for a in accs), "val_accs": accs, "A": best}


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
