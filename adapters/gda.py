"""GDA: Gaussian discriminant analysis on the few-shot image features, blended with the zero-shot logits.

Wang et al., "A Hard-to-Beat Baseline for Training-free CLIP-based Adaptation", ICLR 2024; defaults from the
authors' code (github.com/mrflogs/ICLR24 @ 560fe21, ``main_few_shots.py:run``, ``configs/few_shots/*.yaml``)::

    logits(x) = zero-shot logits(x) + alpha * (f W^T + b)
    W = mu Sigma^-1,  b_c = log(1/C) - mu_c Sigma^-1 mu_c / 2          # mu: [C, D] class means

with ``f`` the image in the geometry's linear space, class means ``mu`` over ``views`` (10, the authors'
``augment_epoch``) augmented views of every training image, and the shared covariance's inverse from the
authors' shrinkage estimator ``Sigma^-1 = D pinv((N - 1) S + tr(S) I)``, S the covariance of the
class-centred features (``torch.cov``, as theirs). Nothing is trained; alpha is searched over
``[1e-4, 1e-3, ..., 100]`` on validation. With alpha = 0 (and before fit) the logits are the zero-shot logits.

Geometry: ``f = geometry.to_linear(geometry.embed_image(x))``: the unit vector on the sphere (clip, sigmoid,
elliptic: the authors' normalised feature), the embedded point for the Euclidean geometries, the tangent
vector at the origin for the hyperbolic ones; the zero-shot part is the geometry's own logits (its logit scale
and bias; the authors' constant 100 is OpenAI CLIP's scale).

Class names it was not trained on (base-to-novel's new classes, a cross-dataset target: ``for_classnames``)
follow the authors' base-to-new code (``main_base2new.py:82-113`` @ 560fe21): with ``t_c`` a new class's text
embedding (its prototype in the linear space) and ``X_c`` the ``neighbours`` (k = 64) training features nearest
to it, among every view of every training image,::

    mu_c = (sum(X_c) + 16 t_c) / (k + 16)                       # 16: text_copies
    Sigma^-1 = D mean_c pinv(R_c^T R_c + tr(R_c^T R_c) / (k - 1) I),   R_c = X_c - t_c

and the same discriminant, blended with the new names' zero-shot logits at the alpha searched on the trained
classes. Nearest is by the geometry's similarity to the prototype (the authors' ``w @ vecs.T``, the cosine: the
same in the clip, sigmoid and elliptic geometries); the means and scatters live in the linear space. The
training points are a persistent buffer (``train_points``, N x D, every view: 10 x the training images by
default), so a saved run and its export score new names too. A domain-shift target of trained classes keeps the
trained rows (``for_target``, as the authors' ``main_robustness.py`` maps their logits). For the trained classes
their base-to-new code estimates the covariance differently, ``pinv`` of the mean of the per-class covariances
(``main_base2new.py:56-57``): ``adapter.covariance=class_mean``, set with the tie rule by ``preset=base2new``.

Where fewclip differs, and why:

* alpha is searched on fewclip's **few-shot validation split**; the authors search the dataset's full
  validation split, and for ImageNet the test set (``val_features = test_features`` in ``main_few_shots.py``).
* Ties of validation accuracy (frequent on a few validation images, 7 candidates) go to the lowest validation
  cross-entropy; ``tie_break=first`` is the authors' first maximum (strict ``>``, from alpha 1e-4 up). Where every
  candidate scores 0% the authors keep alpha = 0.1; fewclip keeps the first (or lowest-loss) candidate.
* The estimate runs in float64 (the authors' float32 on GPU).
* New classes: the authors write ``512 * pinv(... + tr * torch.eye(512))``, ViT-B/16's width (their base-to-new
  configs all use it); fewclip uses D, the same there. Where there are fewer than k training features, fewclip
  takes all of them (the authors' ``torch.topk`` would fail). Their 16 copies of the text embedding equal their
  16 shots; fewclip keeps 16 at any shots (``adapter.text_copies``).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from fewclip.adapter.base import Adapter, AdapterConfig, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._cache import TIE_BREAKS, choose, scored, text_classifier
from fewclip.adapters.linear_probe import probe_features
from fewclip.config.presets import Preset, Setting, register_presets

log = logging.getLogger(__name__)

COVARIANCES = ("shrinkage", "class_mean")  # GDAConfig.covariance: main_few_shots.py's, main_base2new.py's


@dataclass
class GDAConfig(AdapterConfig):
    name: str = field(default="gda", metadata={"help": "The method (`fewclip adapters` lists them)."})
    views: int = field(default=10, metadata={"help": "augmented views of each training image in the class "
                                                     "means and covariance (the authors' augment_epoch)"})
    alphas: list[float] = field(default_factory=lambda: [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0],
                                metadata={"help": "blend weights searched on validation (the authors' list)"})
    init_alpha: float = field(default=0.1, metadata={"help": "alpha without a search or validation images "
                                                             "(the authors' starting best_alpha)"})
    search: bool = field(default=True, metadata={"help": "search alpha on the few-shot validation split"})
    tie_break: str = field(default="loss", metadata={"help": "among equal validation accuracies: 'loss' (lowest "
                                                             "cross-entropy) or 'first' (the authors')"})
    covariance: str = field(default="shrinkage", metadata={"help": "the trained classes' shared covariance: "
                                                                   "'shrinkage' (the authors' few-shot estimator) or "
                                                                   "'class_mean' (their base-to-new code: the mean of "
                                                                   "the per-class covariances)"})
    neighbours: int = field(default=64, metadata={"help": "new class names: training features nearest to each "
                                                          "name's text embedding that make its Gaussian (the "
                                                          "authors' k)"})
    text_copies: int = field(default=16, metadata={"help": "new class names: copies of the text embedding "
                                                           "averaged with the neighbours into the class mean (the "
                                                           "authors' 16)"})

    def __post_init__(self) -> None:
        if self.views < 0:
            raise ValueError(f"adapter.views must be >= 0 (0: the un-augmented features), got {self.views}")
        if not self.alphas or any(not a >= 0 for a in self.alphas):
            raise ValueError(f"adapter.alphas must be a non-empty list of values >= 0, got {list(self.alphas)}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"adapter.tie_break must be one of {', '.join(TIE_BREAKS)}, got {self.tie_break!r}")
        if self.covariance not in COVARIANCES:
            raise ValueError(f"adapter.covariance must be one of {', '.join(COVARIANCES)}, got {self.covariance!r}")
        if self.neighbours < 2:
            raise ValueError(f"adapter.neighbours must be >= 2 (a covariance of the neighbours), got {self.neighbours}")
        if self.text_copies < 0:
            raise ValueError(f"adapter.text_copies must be >= 0, got {self.text_copies}")


def discriminant(mus: Tensor, cov_inv: Tensor):
    """The linear discriminant of Gaussians with means mus [C, D], a shared inverse covariance [D, D] and equal
    priors: (W [C, D], b [C]) with ``W = mu Sigma^-1``, ``b_c = log(1/C) - mu_c Sigma^-1 mu_c / 2``."""
    C, D = mus.shape
    W = mus @ cov_inv  # [C, D]
    log_prior = torch.full((C,), 1.0 / C, dtype=mus.dtype, device=mus.device).log()
    return W, log_prior - (W * mus).sum(-1) / 2


@torch.no_grad()
def gda_classifier(f: Tensor, y: Tensor, n_classes: int, covariance: str = "shrinkage"):
    """The authors' GDA estimate from linear-space features f [N, D] with labels y [N]: (W [C, D], b [C]).

    ``covariance``: ``"shrinkage"``, ``D pinv((N - 1) S + tr(S) I)`` with S the covariance of the class-centred
    features (``main_few_shots.py:56-57``); ``"class_mean"``, ``pinv`` of the mean of the per-class covariances
    (``main_base2new.py:56-57``)."""
    N, D = f.shape
    mus = torch.stack([f[y == c].mean(0) for c in range(n_classes)])  # [C, D]
    if covariance == "class_mean":
        cov_inv = torch.linalg.pinv(torch.stack([f[y == c].T.cov() for c in range(n_classes)]).mean(0))
    else:
        centred = torch.cat([f[y == c] - mus[c] for c in range(n_classes)])  # [N, D]
        cov = centred.T.cov()  # [D, D]
        eye = torch.eye(D, dtype=f.dtype, device=f.device)
        cov_inv = D * torch.linalg.pinv((centred.shape[0] - 1) * cov + cov.trace() * eye)
    return discriminant(mus, cov_inv)


@torch.no_grad()
def knn_gaussians(f: Tensor, w: Tensor, near: Tensor, text_copies: int):
    """The authors' Gaussians of classes without training images (``main_base2new.py:85-107``), from linear-space
    training features f [N, D], the classes' text embeddings w [C, D] in the same space and near [C, k], the
    indices of each class's k nearest training features: (means [C, D], the shared inverse covariance [D, D]).

    A class's mean averages its k neighbours and ``text_copies`` copies of its text embedding; its scatter is
    that of its neighbours about the text embedding, ``R^T R`` (``(k - 1) S``), shrunk by ``tr(S) I``; the
    shared inverse is D times the mean over the classes of their scatters' pseudo-inverses."""
    C, k = near.shape
    N, D = f.shape
    eye = torch.eye(D, dtype=f.dtype, device=f.device)
    means = torch.empty(C, D, dtype=f.dtype, device=f.device)
    cov_inv = torch.zeros(D, D, dtype=f.dtype, device=f.device)
    for c in range(C):  # one [D, D] at a time: C of them at once would be C x D^2 floats
        X = f[near[c]]  # [k, D]
        means[c] = (X.sum(0) + text_copies * w[c]) / (k + text_copies)
        R = X - w[c]  # [k, D]
        scatter = R.T @ R  # [D, D]
        cov_inv += torch.linalg.pinv(scatter + scatter.trace() / (k - 1) * eye)
    return means, D * cov_inv / C


class GDA(Adapter):
    """Zero-shot logits plus alpha times a Gaussian discriminant on the image features."""

    name = "gda"
    trained_by = "fit"
    # Other class names (base-to-novel's new classes, a cross-dataset target) get Gaussians synthesised from the
    # training images nearest to their text embeddings, as the authors' main_base2new.py does (for_classnames).
    supports_new_classes = True

    def __init__(self, cfg: GDAConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                 generator: Optional[torch.Generator] = None):  # deterministic: no random draws
        super().__init__(cfg, backbone, classnames, templates)
        protos = text_classifier(backbone, self.classnames, self.templates).prototypes
        C, D = protos.shape
        self.register_buffer("prototypes", protos, persistent=False)  # rebuilt from the class names
        # Until fit: no discriminant and alpha 0, the zero-shot classifier.
        self.register_buffer("weight", torch.zeros(C, D))
        self.register_buffer("bias", torch.zeros(C))
        self.register_buffer("alpha", torch.zeros(()))
        # fit's training images (every view) as points of the geometry, where new class names find their
        # neighbours; saved with the rest, so that a reloaded run or an export scores new names as the run did
        self.register_buffer("train_points", torch.zeros(0, D))

    def load_adapter_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Load a saved state whatever its number of training points (an unfitted adapter's: none)."""
        if "train_points" in sd:
            self.train_points = torch.empty_like(sd["train_points"], device=self.train_points.device)
        super().load_adapter_state_dict(sd)

    def gda_logits(self, features: Tensor) -> Tensor:
        """The discriminant's logits f W^T + b of raw features [B, D] -> [B, C] (without alpha)."""
        f = probe_features(self.backbone.geometry, features)
        return f @ self.weight.to(f.dtype).T + self.bias.to(f.dtype)

    def forward(self, features: Tensor) -> Tensor:
        B, D = features.shape
        features = features.to(self.prototypes.device)
        zs = self.backbone.geometry.image_logits(features, self.prototypes.to(features.dtype))
        return zs + self.alpha.to(zs.dtype) * self.gda_logits(features)

    def fit_views(self) -> int:
        return self.cfg.views

    @torch.no_grad()
    def fit(self, data) -> dict:
        """Class means and the shared covariance from every view, then alpha searched on validation."""
        cfg: GDAConfig = self.cfg
        views = data.views[: cfg.views] if cfg.views else [data.train]
        dev = self.prototypes.device
        x = torch.cat([v.x for v in views]).to(dev).double()
        y = torch.cat([v.y for v in views]).to(dev)
        C = len(self.classnames)
        missing = sorted(set(range(C)) - set(y.tolist()))
        if missing:
            raise ValueError(f"gda needs training images of every class; none of {missing[:5]}")
        counts = torch.bincount(y, minlength=C)
        if cfg.covariance == "class_mean" and int(counts.min()) < 2:
            raise ValueError(f"gda with adapter.covariance=class_mean needs 2 training features of every class (a "
                             f"covariance each); class {int(counts.argmin())} has 1: raise adapter.views or shots")
        g = self.backbone.geometry
        points = g.embed_image(x)  # [N, D]
        W, b = gda_classifier(g.to_linear(points), y, C, cfg.covariance)
        self.weight.copy_(W.to(self.weight.dtype))
        self.bias.copy_(b.to(self.bias.dtype))
        self.train_points = points.to(self.weight.dtype)
        return self.search(data.val)

    @torch.no_grad()
    def search(self, val) -> dict:
        """alpha: the candidate with the best validation accuracy (ties: ``tie_break``)."""
        cfg: GDAConfig = self.cfg
        vx, vy = val
        if not cfg.search or vy.numel() == 0:
            if cfg.search:
                log.warning("gda: no validation images; keeping alpha=%g", cfg.init_alpha)
            self.alpha.fill_(cfg.init_alpha)
            return {"alpha": cfg.init_alpha, "searched": False}
        vx = vx.to(self.prototypes.device)
        zs = self.backbone.geometry.image_logits(vx, self.prototypes.to(vx.dtype))
        gda = self.gda_logits(vx)
        scores = [scored(zs + a * gda, vy) for a in cfg.alphas]
        i = choose([s[0] for s in scores], [s[1] for s in scores], cfg.tie_break)
        self.alpha.fill_(float(cfg.alphas[i]))
        zs_acc = scored(zs, vy)[0]
        log.info("gda: alpha=%g (val top1 %.2f%%, zero-shot %.2f%%)", cfg.alphas[i], scores[i][0], zs_acc)
        return {"alpha": float(cfg.alphas[i]), "searched": True, "val_acc": scores[i][0],
                "zeroshot_val_acc": zs_acc, "val_accs": [s[0] for s in scores]}

    # -- other class names ---------------------------------------------------
    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> GDA:
        """GDA for other class names and templates, in eval mode: zero-shot logits plus alpha (the fitted one)
        times the discriminant of Gaussians synthesised from the training images nearest to each name's
        prototype (``knn_gaussians``). Unfitted, the zero-shot classifier of those names."""
        if list(classnames) == self.classnames and list(templates) == self.templates:
            return self
        other = self._built_for(classnames, templates)
        if len(self.train_points):
            W, b = self.synthesised_discriminant(other.prototypes)
            other.weight.copy_(W.to(other.weight.dtype))
            other.bias.copy_(b.to(other.bias.dtype))
        return other

    def for_target(self, classnames: Sequence[str], templates: Sequence[str],
                   class_map: Optional[Sequence[int]] = None) -> GDA:
        """A target of trained classes (``class_map``: their trained labels; a domain-shift target) keeps their
        prototypes and discriminant rows, as the authors' ``main_robustness.py:142-145`` scores ImageNet-V2, -Sketch,
        -A and -R (``test_logits @ label_mapping``); a target of other classes gets ``for_classnames``."""
        if class_map is None:
            return self.for_classnames(classnames, templates)
        rows = list(class_map)
        if rows == list(range(len(self.classnames))):
            return self
        other = self._built_for(classnames, templates)
        other.prototypes = self.prototypes[rows]
        other.weight.copy_(self.weight[rows])
        other.bias.copy_(self.bias[rows])
        return other

    def _built_for(self, classnames: Sequence[str], templates: Sequence[str]) -> GDA:
        """A GDA of the same config, alpha and training points for other class names, in this one's dtype and
        device, in eval mode (its discriminant zero: the caller sets it)."""
        other = type(self)(self.cfg, self.backbone, classnames, templates).to(self.weight).eval()
        other.train_points = self.train_points
        other.alpha.copy_(self.alpha)
        return other

    @torch.no_grad()
    def synthesised_discriminant(self, prototypes: Tensor):
        """(W [C, D], b [C]) for classes without training images, from their prototypes [C, D]: each class's k
        nearest training points by the geometry's similarity (``adapter.neighbours``, at most all of them), then
        ``knn_gaussians`` in the linear space, in float64."""
        cfg: GDAConfig = self.cfg
        g = self.backbone.geometry
        points = self.train_points.double()  # [N, D]
        protos = prototypes.to(points)  # [C, D]
        k = min(cfg.neighbours, len(points))
        if k < 2:
            raise ValueError(f"gda scores new class names from at least 2 training features; it was fitted on "
                             f"{len(points)}")
        if k < cfg.neighbours:
            log.info("gda: %d training features, fewer than adapter.neighbours=%d: each new class uses all of them",
                     len(points), cfg.neighbours)
        near = g.similarity(points, protos).T.topk(k, dim=-1).indices  # [C, k]
        means, cov_inv = knn_gaussians(g.to_linear(points), g.to_linear(protos), near, cfg.text_copies)
        return discriminant(means, cov_inv)


register_adapter("gda", GDAConfig, GDA, export=STATE)

register_presets(
    "gda",
    Preset("authors", "GDA's released code (main_few_shots.py:run, configs/few_shots/*.yaml)", settings=(
        Setting("adapter.tie_break", "first", "mrflogs/ICLR24@560fe21 main_few_shots.py:74",
                "their search keeps the first best alpha (strict >); fewclip the lowest validation loss"),),
        not_expressed=("the search on the dataset's whole validation split (mrflogs/ICLR24@560fe21 "
                       "main_few_shots.py:70-76); fewclip searches its few-shot validation split",)),
    Preset("base2new", "GDA's base-to-new code (main_base2new.py:run, configs/base2new/*.yaml)", settings=(
        Setting("adapter.tie_break", "first", "mrflogs/ICLR24@560fe21 main_base2new.py:71",
                "their search keeps the first best alpha (strict >); fewclip the lowest validation loss"),
        Setting("adapter.covariance", "class_mean", "mrflogs/ICLR24@560fe21 main_base2new.py:56-57",
                "their base classes' covariance: pinv of the mean of the per-class covariances, not shrunk"),),
        not_expressed=("the search on the base classes' whole validation split (mrflogs/ICLR24@560fe21 "
                       "main_base2new.py:64-73); fewclip searches its few-shot validation split",)),
    on_test=("GDA's authors search alpha on ImageNet's test set (val_features = test_features), "
             "mrflogs/ICLR24@560fe21 main_few_shots.py:137"))
