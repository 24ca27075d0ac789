"""LP++: a linear probe plus class-wise multiples of the zero-shot similarities, with Lipschitz step sizes.

Huang et al., "LP++: A Surprisingly Strong Linear Probe for Few-Shot CLIP", CVPR 2024; defaults from the
authors' code (github.com/FereshteShakeri/FewShot-CLIP-Strong-Baseline @ f81054f,
``methods/linear_probe_p2.py``, ``methods/utils.py``, ``configs/base.yaml``)::

    logits(x) = f W^T + b + alpha * s(x, t)          # W: [C, D], b: [C], alpha: [C]

with ``f`` the image's features and ``s(x, t_c)`` its similarity to class c's zero-shot prototype (the
paper's ``f^T (w_c + alpha_c t_c)``; the code adds a bias). What the code does, and fewclip with it:

* ``W`` starts at the per-class **sums** of the training features (the code's ``compute_centroids`` leaves
  the division by the count commented out), ``alpha`` at one scalar for every class,
  ``250 * mean over classes of the mean similarity of a class's images to its own text`` (the paper
  describes class-wise values; the code averages them). fewclip starts ``b`` at 0 (the code leaves
  ``nn.Linear``'s random bias, which the paper does not have; ``bias_init="linear"`` draws it as the code).
* Step sizes from the training features (no learning-rate search): ``lr_w = 4 N / lambda_max(F^T F)`` and
  ``lr_alpha = N / (4 max_c sum_i s(x_i, t_c)^2)``.
* 300 full-batch epochs: SGD with momentum 0.9 at ``lr_w`` on ``W`` and ``b`` every epoch (the paper's
  block majorize-minimize steps are, in the code, this momentum SGD), and a plain step
  ``alpha -= lr_alpha * grad`` every 10th epoch.
* The epoch with the best few-shot validation accuracy is kept (ties: the later epoch; the code's ``>=``).
* Training features: one augmented view of each training image (the code's single augmented pass; here
  the run's shared view 0).

Where fewclip differs, and why:

* ``alpha_grad="last"`` (default): the alpha step uses the gradient of the epoch it is taken in. The code
  never zeroes alpha's gradient (the optimiser zeroes W and b only), so each step uses the *sum of every
  gradient since epoch 0*: once training converges the sum stays at a constant vector and alpha keeps
  moving by ``lr_alpha`` times it every 10 epochs, which is not a descent step of any objective.
  ``alpha_grad="accumulated"`` reproduces the code.
* Validation is fewclip's few-shot split (``min(shots, 4)`` images per class; the authors draw K per class).

Geometry: ``f`` is the image in the geometry's linear space (``probe_features``, as the linear probe: the
unit vector on the sphere, the embedded point for the Euclidean geometries, the tangent vector at the
origin for the hyperbolic ones) and ``s`` the geometry's similarity to the zero-shot prototypes (the
cosine in the clip geometry, as in the code; minus a distance or an angle elsewhere). The code's alpha
initialisation assumes a cosine: where ``250 * mean own-class similarity`` is not positive (minus a
distance or an angle is never positive) alpha starts at the geometry's logit scale instead, the weight at
which the text term is the zero-shot logits. ``init="zeroshot"`` starts at the zero-shot classifier itself
(``W = 0``, ``b`` the geometry's logit bias, alpha its logit scale): the logits then equal the zero-shot
logits in every geometry.

Training runs in float64 on the cached features (300 full-batch steps on [N, D]: milliseconds).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import text_classifier
from fewclip.adapters.linear_probe import probe_features
from fewclip.config.presets import Preset, Setting, register_presets
from fewclip.features.encode import progress

log = logging.getLogger(__name__)

INITS = ("lpp", "zeroshot")
ALPHA_GRADS = ("last", "accumulated")
BIAS_INITS = ("zero", "linear")


@dataclass
class LPPConfig(AdapterConfig):
    name: str = field(default="lpp", metadata={"help": "The method (`fewclip adapters` lists them)."})
    epochs: int = field(default=300, metadata={"help": "Full-batch epochs (the authors' train_epoch)."})
    alpha_every: int = field(default=10, metadata={"help": 'alpha takes a step every this many epochs.'})
    alpha_grad: str = field(default="last", metadata={"help": (
        'The gradient of alpha\'s step: "last" (that epoch\'s) or "accumulated" (every epoch\'s so far: the code\'s).')})
    init: str = field(default="lpp", metadata={"help": (
        '"lpp": W at the class sums, alpha from the own-class similarity (the code); "zeroshot": the zero-shot '
        'weights.')})
    alpha_init_factor: float = field(default=250.0, metadata={"help": (
        "The constant of the code's alpha initialisation (250 * mean own-class similarity).")})
    views: int = field(default=1, metadata={"help": (
        'Augmented views of the training images trained on (the authors: one augmented pass).')})
    bias_init: str = field(default="zero", metadata={"help": (
        'The bias\'s start with init=lpp: "zero" (the paper has no bias), or "linear" (the code\'s nn.Linear default, '
        'uniform in +-1/sqrt(D), drawn from the run\'s generator).')})

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"adapter.epochs must be >= 0, got {self.epochs}")
        if self.alpha_every < 1:
            raise ValueError(f"adapter.alpha_every must be >= 1, got {self.alpha_every}")
        if self.alpha_grad not in ALPHA_GRADS:
            raise ValueError(f"adapter.alpha_grad must be one of {', '.join(ALPHA_GRADS)}, got {self.alpha_grad!r}")
        if self.init not in INITS:
            raise ValueError(f"adapter.init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.bias_init not in BIAS_INITS:
            raise ValueError(f"adapter.bias_init must be one of {', '.join(BIAS_INITS)}, got {self.bias_init!r}")
        if not self.alpha_init_factor > 0:
            raise ValueError(f"adapter.alpha_init_factor must be > 0, got {self.alpha_init_factor}")
        if self.views < 0:
            raise ValueError(f"adapter.views must be >= 0 (0: the un-augmented features), got {self.views}")


def lpp_step_sizes(f: Tensor, s: Tensor) -> tuple:
    """(lr_w, lr_alpha) of LP++ from the training features f [N, D] and similarities s [N, C]."""
    N, D = f.shape
    lr_w = 4 * N / float(torch.linalg.eigvalsh(f.T @ f).max())
    lr_alpha = N / (4 * float(s.pow(2).sum(0).max()))
    return lr_w, lr_alpha


class LPP(Adapter):
    """A linear probe plus class-wise multiples of the zero-shot similarities."""

    name = "lpp"
    trained_by = "fit"

    def __init__(self, cfg: LPPConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        g = backbone.geometry
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes
        C, D = protos.shape
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        # The zero-shot classifier until fit: W = 0, b = the geometry's logit bias, alpha = its logit scale.
        self.weight = nn.Parameter(torch.zeros(C, D))
        self.bias = nn.Parameter(self._logit_bias().float().expand(C).clone())
        self.alpha = nn.Parameter(g.scale.detach().float().expand(C).clone())

    @torch.no_grad()
    def _logit_bias(self) -> Tensor:
        """What the geometry adds to scale * similarity (SigLIP's bias; 0 for the others), a 0-dim tensor on the
        prototypes' device (read without a host sync)."""
        g, p = self.backbone.geometry, self.prototypes[:1]
        return (g.logits(p, p) - g.scale * g.similarity(p, p)).reshape(())

    def _parts(self, features: Tensor):
        """Linear-space features [B, D] and zero-shot similarities [B, C] of raw features [B, D]."""
        g = self.backbone.geometry
        return probe_features(g, features), g.similarity(g.embed_image(features), self.prototypes.to(features.dtype))

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        f, s = self._parts(features.to(self.weight.device))
        with torch.autocast(f.device.type, enabled=False):
            return F.linear(f, self.weight, self.bias) + self.alpha * s  # [B, C]

    def fit_views(self) -> int:
        return self.cfg.views

    def fit(self, data) -> dict:
        """Full-batch LP++ in float64; keeps the epoch with the best validation accuracy."""
        cfg: LPPConfig = self.cfg
        C, D = self.weight.shape
        train = data.views[0] if cfg.views else data.train
        dev = self.weight.device
        f, s = self._parts(train.x.to(dev).double())
        y = train.y.to(dev)
        vf, vs = self._parts(data.val.x.to(dev).double())
        vy = data.val.y.to(dev)
        N = len(y)
        if N == 0:
            raise ValueError("lpp.fit needs training images, got none")
        onehot = F.one_hot(y, C).double()
        W = torch.zeros(C, D, dtype=torch.float64, device=dev)
        b = self._logit_bias().double().expand(C).clone()
        alpha0 = float(self.backbone.geometry.scale)
        if cfg.init == "lpp":
            W = onehot.T @ f  # class sums
            b.zero_()
            if cfg.bias_init == "linear":  # nn.Linear(D, C)'s default bias: U(-1/sqrt(D), 1/sqrt(D))
                u = torch.rand(C, generator=data.generator, dtype=torch.float64)
                b = ((2 * u - 1) / D ** 0.5).to(dev)
            own = ((s * onehot).sum(0) / onehot.sum(0).clamp_min(1)).mean()  # mean over classes of own-class means
            if cfg.alpha_init_factor * float(own) > 0:
                alpha0 = cfg.alpha_init_factor * float(own)
        alpha = torch.full((C,), alpha0, dtype=torch.float64, device=dev)
        return self.train_blocks(f, s, y, vf, vs, vy, W, b, alpha)

    def train_blocks(self, f: Tensor, s: Tensor, y: Tensor, vf: Tensor, vs: Tensor, vy: Tensor, W: Tensor,
                     b: Tensor, alpha: Tensor, on_epoch: Optional[Callable[[int, Tensor, Tensor, Tensor], None]] = None
                     ) -> dict:
        """LP++'s epochs from (W, b, alpha) on features f [N, D], similarities s [N, C], labels y [N], with
        validation (vf, vs, vy); sets the adapter to the best validation epoch and returns what it did.
        ``on_epoch(epoch, W, b, alpha)``, if given, sees the parameters after every epoch (for diagnostics)."""
        cfg: LPPConfig = self.cfg
        lr_w, lr_alpha = lpp_step_sizes(f, s)
        alpha_init = float(alpha[0])
        W, b, alpha = (t.clone().requires_grad_(True) for t in (W, b, alpha))
        opt = torch.optim.SGD([W, b], lr=lr_w, momentum=0.9)
        has_val = vy.numel() > 0
        best = {"acc": -1.0, "epoch": 0, "state": (W.detach().clone(), b.detach().clone(), alpha.detach().clone())}
        loss = torch.tensor(float("nan"))
        with torch.enable_grad():
            for epoch in progress(range(cfg.epochs), desc="lp++", unit="epoch", leave=False):
                loss = F.cross_entropy(f @ W.T + b + alpha * s, y)
                opt.zero_grad()
                if cfg.alpha_grad == "last":
                    alpha.grad = None
                loss.backward()
                opt.step()
                if (epoch + 1) % cfg.alpha_every == 0:
                    with torch.no_grad():
                        alpha -= lr_alpha * alpha.grad
                if on_epoch is not None:
                    on_epoch(epoch, W.detach(), b.detach(), alpha.detach())
                if has_val:
                    with torch.no_grad():
                        acc = 100.0 * float(((vf @ W.T + b + alpha * vs).argmax(-1) == vy).double().mean())
                    if acc >= best["acc"]:  # ties: the later epoch (the code's >=)
                        best = {"acc": acc, "epoch": epoch,
                                "state": (W.detach().clone(), b.detach().clone(), alpha.detach().clone())}
        if not has_val or cfg.epochs == 0:
            if cfg.epochs and not has_val:
                log.warning("lpp: no validation images; keeping the last epoch")
            best = {"acc": None, "epoch": cfg.epochs - 1, "state": (W.detach(), b.detach(), alpha.detach())}
        with torch.no_grad():
            for p, v in zip((self.weight, self.bias, self.alpha), best["state"]):
                p.copy_(v.to(p.dtype))
        log.info("lp++: kept epoch %d of %d (val top1 %s), lr_w %.4g, lr_alpha %.4g", best["epoch"] + 1,
                 cfg.epochs, "-" if best["acc"] is None else f"{best['acc']:.2f}%", lr_w, lr_alpha)
        return {"best_epoch": best["epoch"] + 1, "epochs": cfg.epochs, "val_acc": best["acc"],
                "final_loss": float(loss.detach()), "lr_w": lr_w, "lr_alpha": lr_alpha, "alpha_init": alpha_init}


register_adapter("lpp", LPPConfig, LPP, export=STATE)

LPP_REPO = "FereshteShakeri/FewShot-CLIP-Strong-Baseline@f81054f"
register_presets(
    "lpp",
    Preset("authors", "LP++'s released code (methods/linear_probe_p2.py, configs/base.yaml)", settings=(
        Setting("adapter.alpha_grad", "accumulated", f"{LPP_REPO} methods/linear_probe_p2.py:133,139",
                "their optimiser zeroes W's and b's gradients only, so alpha steps on the sum of every epoch's"),
        Setting("adapter.bias_init", "linear", f"{LPP_REPO} methods/linear_probe_p2.py:96",
                "their classifier is an nn.Linear with its random default bias; the paper has no bias"),),
        not_expressed=(f"K validation images per class ({LPP_REPO} main.py:94); fewclip's few-shot validation split "
                       f"has min(shots, 4)",)),
)
