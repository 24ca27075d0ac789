"""Transductive inference on top of any method's predictions: TransCLIP (Zanella et al., NeurIPS 2024).

TransCLIP is not a method but a plug-in: given the *unlabelled test features* of a whole test set and a method's
predictions on them, it fits a Gaussian mixture (one mean per class, one shared diagonal variance) to the test
features, regularised by the method's predictions (a KL term, weight ``lam``) and by a k-nearest-neighbour
graph over the test set (a Laplacian term), and returns new class probabilities for every test image. With a
labelled support set (TransCLIP-FS) the support images also pull the class means, with a weight ``gamma``
searched on validation.

:func:`transclip` is a pure tensor function, written after the authors' ``TransCLIP_solver``
(MaxZanella/transduction-for-vlms @ 6a9e8f3): 10 outer iterations of (z, mu, sigma) updates, 5 inner z-updates
at temperature 50, 3 neighbours, the 8 most confident images per class to start the means, lambda 1 (0.5 with
a support set), gamma in (0.002, 0.01, 0.02, 0.2) with a support set. It is pinned to their code in
``tests/test_transductive.py`` (fixtures in ``tests/fixtures/cache_ref/transclip.*``).

Every geometry: the authors' features are unit vectors (the clip geometry). Here an image is its point's
coordinates in the geometry's linear space (``geometry.to_linear(geometry.embed_image(raw))``); a class mean is
the weighted mean of those coordinates taken back to the geometry (``to_linear(from_linear(mean))``: on the
sphere the normalised mean, the authors' own; the mean itself in Euclidean space and in the hyperbolic tangent
space); neighbours are ranked by the geometry's similarity and weighted by the cosine of their coordinates (the
authors' dot product of unit vectors); the variance starts at the mean squared norm over D (1/D on the sphere,
the authors' value).

Where fewclip differs from the authors' code, deliberately (each reproducible with an argument, which the parity
tests use):

* ``prior="fixed"``: the method's predictions stay the prior of every z-update, as in the paper's objective and
  in the authors' zero-shot path. Their on-top path (``initial_predictions``, no support set) hands the solver a
  tensor that its z-update then overwrites in place (``y_hat`` and ``z`` are one tensor), so there the prior is
  the current z; ``prior="current"`` is that.
* ``row_order="aligned"``: with a support set, the neighbour graph's rows and the assignment rows are in the same
  order (test images, then support images). The authors stack the graph's rows support-first and the
  assignments test-first, so each of the first S test images takes the neighbourhood of a support image;
  ``row_order="authors"`` is that.
* With a support set, the result is the assignment of the gamma with the best validation accuracy (whose test
  accuracy the authors report); their solver returns the last gamma's.

The caveat, which no setting removes: the result depends on the whole test set. Each class's mean starts at
its 8 most confident test images, and every class is assumed present. When a test set holds few of the
classes (a stream of small batches, a test set restricted to a subset of the classes), the absent classes
still get a mean and take images from the present ones, and TransCLIP can end below the method it started
from (``tests/test_transductive.py`` shows it on a test set of two classes).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fewclip.backbones.geometry import Geometry
from fewclip.data.splits import test_items
from fewclip.features.encode import accuracy
from fewclip.training.engine import RunFeatures, amp_autocast
from fewclip.training.evals import scorer_for
from fewclip.utils.errors import NonFiniteError

log = logging.getLogger(__name__)

MODES = ("none", "transclip")
PRIORS = ("fixed", "current")
ROW_ORDERS = ("aligned", "authors")
GAMMAS = (0.002, 0.01, 0.02, 0.2)  # the authors' search with a support set


class TransCLIPResult(NamedTuple):
    probs: Tensor  # [Q, K] class probabilities of the test images (the selected gamma's)
    gamma: float  # the gamma used (0 without a support set)
    val_acc: Optional[float]  # validation accuracy of that gamma, percent (None without a support set)
    per_gamma: list[Tensor]  # [Q, K] assignments at the end of each gamma, in order


def _renorm(geometry: Geometry, v: Tensor) -> Tensor:
    """Linear-space vectors taken to the geometry and back: the sphere's normalisation, identity elsewhere."""
    return geometry.to_linear(geometry.from_linear(v))


def _coords(geometry: Geometry, raw: Tensor) -> Tensor:
    return geometry.to_linear(geometry.embed_image(raw))


def knn_graph(geometry: Geometry, rows: Tensor, cols: Tensor, n_neighbors: int, chunk: int = 4096) -> Tensor:
    """The authors' affinity graph: each row point's ``n_neighbors`` most similar column points after the first
    (itself, for a test image against the test set), weighted by the cosine of their coordinates; a sparse
    [R, Q] matrix. ``rows``/``cols`` are raw image features [R, D] / [Q, D]."""
    R, Q = rows.shape[0], cols.shape[0]
    if Q <= n_neighbors:
        raise ValueError(f"TransCLIP needs more test images than neighbours ({n_neighbors}); got {Q}")
    pr, pc = geometry.embed_image(rows), geometry.embed_image(cols)
    lr, lc = F.normalize(geometry.to_linear(pr), dim=-1), F.normalize(geometry.to_linear(pc), dim=-1)
    idx, vals = [], []
    for s in range(0, R, chunk):
        sim = geometry.similarity(pr[s:s + chunk], pc)  # [r, Q]
        nn_ = sim.topk(n_neighbors + 1, dim=-1, largest=True).indices[:, 1:]  # [r, n]
        idx.append(nn_)
        vals.append((lr[s:s + chunk, None, :] * lc[nn_]).sum(-1))  # [r, n] cosines
    knn, values = torch.cat(idx), torch.cat(vals)
    r = torch.arange(R, device=rows.device).repeat_interleave(n_neighbors)
    return torch.sparse_coo_tensor(torch.stack([r, knn.flatten()]), values.flatten(), size=(R, Q),
                                   check_invariants=False)


def _log_gauss(x: Tensor, mu: Tensor, var: Tensor) -> Tensor:
    """-1/2 sum_d (x_d - mu_kd)^2 / var_d: [Q, D] x [K, D] x [D] -> [Q, K], expanded into products so that no
    [Q, K, D] tensor is made (ImageNet's 50000 x 1000 x 512 would not fit)."""
    iv = 1.0 / var
    return -0.5 * (((x * x) @ iv)[:, None] - 2.0 * x @ (mu * iv).T + ((mu * mu) @ iv)[None, :])


def _weighted_sq(w: Tensor, x: Tensor, mu: Tensor) -> Tensor:
    """sum_q sum_k w_qk (x_q - mu_k)^2 per dimension: [Q, K] x [Q, D] x [K, D] -> [D], without a [Q, K, D]
    tensor."""
    wk = w.sum(0)  # [K]
    return w.sum(1) @ (x * x) - 2.0 * (mu * (w.T @ x)).sum(0) + wk @ (mu * mu)


def transclip(features: Tensor, logits: Optional[Tensor], geometry: Geometry, *, probs: Optional[Tensor] = None,
              support: Optional[Tensor] = None, support_labels: Optional[Tensor] = None,
              val: Optional[Tensor] = None, val_labels: Optional[Tensor] = None, lam: Optional[float] = None,
              gammas: Optional[Sequence[float]] = None, iters: int = 10, z_iters: int = 5, n_neighbors: int = 3,
              temperature: float = 50.0, n_confident: int = 8, prior: str = "fixed",
              row_order: str = "aligned") -> TransCLIPResult:
    """TransCLIP on the test images ``features`` (raw image features [Q, D]) starting from a method's ``logits``
    [Q, K] (softmaxed) or its ``probs`` [Q, K]. With ``support`` [S, D] and ``support_labels`` [S] (the few-shot
    images) it is TransCLIP-FS, each gamma scored on ``val``/``val_labels`` through each validation image's
    nearest test image (as the authors). Module docstring: the algorithm, the geometry, the differences."""
    if prior not in PRIORS:
        raise ValueError(f"prior must be one of {PRIORS}, got {prior!r}")
    if row_order not in ROW_ORDERS:
        raise ValueError(f"row_order must be one of {ROW_ORDERS}, got {row_order!r}")
    if (logits is None) == (probs is None):
        raise ValueError("transclip takes the method's logits or its probs, not both or neither")
    y_hat = torch.softmax(logits, dim=1) if probs is None else probs
    x = _coords(geometry, features)  # [Q, D]
    Q, D = x.shape
    K = y_hat.shape[1]
    few = support is not None
    lam = (0.5 if few else 1.0) if lam is None else lam
    gammas = list(GAMMAS if few else (0.0,)) if gammas is None else list(gammas)
    T = float(temperature)
    tiny = torch.finfo(x.dtype).tiny  # guards divisions where every probability underflowed (unchanged otherwise)

    if few:
        sx = _coords(geometry, support)  # [S, D]
        onehot = F.one_hot(support_labels, K).to(x.dtype)  # [S, K]
        S = sx.shape[0]
        mu = _renorm(geometry, (onehot.T @ sx) / onehot.sum(0)[:, None].clamp_min(1))
        if row_order == "authors":
            W = knn_graph(geometry, torch.cat([support, features]), features, n_neighbors)
        else:
            W = knn_graph(geometry, torch.cat([features, support]), features, n_neighbors)
    else:
        # the n_confident most confident test images of each class, weighted by their probability
        top = y_hat.topk(min(n_confident, Q), dim=0).indices  # [n, K]
        mask = torch.zeros_like(y_hat).scatter_(0, top, 1.0)
        wz = y_hat * mask
        mu = _renorm(geometry, (wz.T @ x) / wz.sum(0)[:, None].clamp_min(tiny))
        W = knn_graph(geometry, features, features, n_neighbors)
    W = W.to(x.dtype)
    var = torch.full((D,), float((x ** 2).sum(-1).mean()) / D, dtype=x.dtype, device=x.device)
    WT = W.t()
    z = y_hat.clone()
    nb = None
    if few and val is not None:
        nb = geometry.similarity(geometry.embed_image(val), geometry.embed_image(features)).argmax(dim=1)

    per_gamma, best = [], (-1.0, 0)
    for gi, gamma in enumerate(gammas):
        for k in range(iters + 1):
            ll = _log_gauss(x, mu, var)  # [Q, K]
            zz = torch.cat([z, onehot]) if few else z.clone()
            for _ in range(z_iters):
                inter = ll + (T / (2 * n_neighbors)) * (WT @ zz + (W @ zz[:Q])[:Q])
                inter = inter - inter.max(dim=1, keepdim=True).values
                p = y_hat if prior == "fixed" else zz[:Q]
                inter = p ** lam * torch.exp(inter / T)
                zz[:Q] = inter / inter.sum(dim=1, keepdim=True).clamp_min(tiny)
            z = zz[:Q]
            if k == iters:
                break
            # means: weighted by z (and by the support labels at weight gamma * T / S)
            num = (z / Q).T @ x
            den = (z / Q).sum(0)
            if few:
                num = num + (gamma * T / S) * (onehot.T @ sx)
                den = den + (gamma * T / S) * onehot.sum(0)
            mu = _renorm(geometry, num / den[:, None].clamp_min(tiny))
            # the shared diagonal variance
            v = _weighted_sq(z / Q, x, mu)
            total = (z / Q).sum()
            if few and gamma > 0:
                v = v + (gamma * T / S) * _weighted_sq(onehot, sx, mu)
                total = total + (gamma * T / S) * onehot.sum()
            var = v / total
        per_gamma.append(z.clone())
        if nb is not None:
            acc = 100.0 * float((z[nb].argmax(1) == val_labels).double().mean())
            if acc > best[0]:  # strict: the first of equals stays (the authors' rule)
                best = (acc, gi)
    if nb is None:
        return TransCLIPResult(z, float(gammas[-1]), None, per_gamma)
    return TransCLIPResult(per_gamma[best[1]], float(gammas[best[1]]), best[0], per_gamma)


# ---------------------------------------------------------------------------
# a run's test sets, scored a second time (run config ``transductive=transclip``)
# ---------------------------------------------------------------------------


@torch.no_grad()
def method_logits(scorer, feats: Tensor, device, amp: str = "none", batch_size: int = 4096) -> Tensor:
    """A scorer's logits [N, C] (float32, CPU) of raw image features [N, D], in batches."""
    outs = []
    with amp_autocast(device, amp):
        for i in range(0, len(feats), batch_size):
            outs.append(scorer(feats[i:i + batch_size].to(device)).float().cpu())
    return torch.cat(outs)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"transductive must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@torch.no_grad()
def rescore_plan(mode: str, adapter, plan, evals: dict[str, dict[str, Any]], *, templates: str,
                 max_test: Optional[int], train_cfg, seed: int, cache=None, cost=None, batch_size: int = 256,
                 workers: int = 0, amp: str = "none") -> dict[str, Any]:
    """Every test set of ``plan`` that ``evals`` (``fewclip.training.evals.score_plan``'s result) scored, scored a second
    time with ``mode`` on top of the adapter's logits, using that test set's features (read again through the
    run's feature cache, so nothing is encoded twice for a frozen image tower). Adds ``top1_<mode>`` and
    ``per_class_<mode>`` to each entry of ``evals`` in place; returns ``{"transductive": mode,
    "transductive_time_s": seconds}``."""
    check_mode(mode)
    if mode == "none":
        return {}
    t0 = time.perf_counter()
    geometry = adapter.backbone.geometry
    for e in plan.evals:
        entry = evals[e.name]
        if entry.get("top1") is None:  # not scored (n/a): nothing to rescore
            entry[f"top1_{mode}"] = None
            continue
        prompts = e.dataset.prompts(templates)
        scorer, _, _ = scorer_for(adapter, e, prompts, trained_on=e.dataset is plan.train)
        # the frozen tower's test features come from the cache and were counted when scored; an adapted image
        # tower encodes them again, and that is counted
        features = RunFeatures(adapter, e.dataset, None, train_cfg, seed=seed, cache=cache,
                               cost=cost if adapter.trains_image_tower else None, batch_size=batch_size,
                               workers=workers)
        feats, labels = features.test(test_items(e.dataset, max_test))
        device = adapter.backbone.device
        logits = method_logits(scorer, feats, device, amp)
        result = transclip(feats.to(device), logits.to(device), geometry)
        if not torch.isfinite(result.probs).all():
            raise NonFiniteError(f"TransCLIP's probabilities on {e.name} are not finite; the run is not recorded. "
                                 f"Run it without transductive=transclip, or check the test features")
        acc = accuracy(result.probs, labels, e.dataset.classnames)
        entry[f"top1_{mode}"] = acc["top1"]
        entry[f"per_class_{mode}"] = acc["per_class"]
        entry[f"mean_per_class_{mode}"] = acc["mean_per_class"]
        log.info("%s: %s %.2f%% on top of %s's %.2f%%", e.name, mode, acc["top1"], adapter.name, entry["top1"])
    return {"transductive": mode, "transductive_time_s": round(time.perf_counter() - t0, 3)}
