"""Scoring a trained adapter on every test set of a protocol plan (``fewclip.data.protocols``).

A run trains on its plan's training dataset (the whole dataset, the base half of
its classes, or a transfer protocol's source) and is then scored on each test
set of the plan: ``all`` (fewshot), ``base`` and ``new`` (base2new), or
``source`` and each target (cross_dataset, domain_shift). How a test set is
scored is decided once per test set, by what the adapter says it can do
(:func:`scorer_for`):

* an adapter that can score class names it was not trained on
  (``adapter.supports_new_classes``: zero-shot, unified CoOp, LoRA):
  ``adapter.for_classnames(names, templates)`` with the test set's own class
  names and its own dataset's templates (the adapter itself where those are
  its own) on the data it was trained on, ``adapter.for_target`` on every
  other test set (the same class names are not the same task: MMRL fuses its
  heads only on its training data);
* the training classes, for any adapter: the adapter itself;
* some of the training classes (a domain-shift target with a subset of the
  classes, ImageNet-A/R, toy-shapes-outline) and an adapter with one weight per
  trained class (CSC CoOp, the linear probes): the training classifier's logits
  restricted to the target's classes with the plan's class map
  (``restrict_logits``), so the target is evaluated among its own classes, as
  in CoOp/CoCoOp;
* otherwise (new classes for a per-class classifier): no number. The test set
  is recorded with ``top1: null`` and the reason; reports show "n/a".

Image features of a test set come through the run's feature pipeline
(``RunFeatures``): the frozen tower, shared through the sweep's cache, or the
adapter's own adapted image tower.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from fewclip.data.protocols import EvalSet, ProtocolPlan, harmonic_mean, restrict_logits
from fewclip.data.splits import test_items
from fewclip.training.engine import RunFeatures, evaluate

log = logging.getLogger(__name__)

# How a test set was scored (metrics.json: evals.<name>.scored_by); None: not scored (n/a).
SCORED_BY = ("adapter", "for_classnames", "restrict_logits", None)


class RestrictedLogits:
    """An adapter's logits restricted to some of its classes (``class_map[i]``: the trained label of class i)."""

    def __init__(self, adapter, class_map: Sequence[int]):
        self.adapter = adapter
        self.backbone = adapter.backbone
        self.class_map = list(class_map)

    def __call__(self, features):  # [B, D] raw -> [B, len(class_map)]
        return restrict_logits(self.adapter(features), self.class_map)


def scorer_for(adapter, eval_set: EvalSet, templates: Sequence[str], trained_on: bool = True
               ) -> tuple[Optional[Any], Optional[str], str]:
    """``(scorer, scored_by, reason)``: what scores ``eval_set`` (called on raw image features [B, D], giving
    logits over the test set's classes in its label order) and how (one of ``SCORED_BY``). ``scorer`` is None
    where the adapter cannot score these classes, and ``reason`` then says why. ``trained_on``: whether the
    test set is of the data the adapter was trained on (the plan's training dataset: ``all``, ``base``,
    ``source``); any other test set is a target (``adapter.for_target``), whatever its class names."""
    names = list(eval_set.dataset.classnames)
    if adapter.supports_new_classes:
        if trained_on:
            scorer = adapter.for_classnames(names, list(templates))
        else:
            scorer = adapter.for_target(names, list(templates), eval_set.class_map)
        return scorer, ("adapter" if scorer is adapter else "for_classnames"), ""
    if names == list(adapter.classnames):
        return adapter, "adapter", ""
    if eval_set.class_map is not None:
        return RestrictedLogits(adapter, eval_set.class_map), "restrict_logits", ""
    return None, None, (f"adapter {adapter.name!r} has one weight per trained class and cannot score the classes "
                        f"of {eval_set.dataset.name!r}, which it was not trained on")


def score_plan(adapter, plan: ProtocolPlan, *, templates: str, max_test: Optional[int], train_cfg, seed: int,
               cache=None, cost=None, batch_size: int = 256, workers: int = 0, amp: str = "none"
               ) -> dict[str, dict[str, Any]]:
    """Every test set of ``plan`` scored by the trained ``adapter``, in the plan's order: ``{name: {top1,
    per_class, n_test, dataset, view, n_classes, templates, scored_by[, reason]}}``; ``top1`` and
    ``per_class`` are None (and ``reason`` says why) where the adapter cannot score the test set's classes.
    ``templates`` is the run's ``data.templates`` mode, applied to each test set's own dataset."""
    out: dict[str, dict[str, Any]] = {}
    for e in plan.evals:
        prompts = e.dataset.prompts(templates)
        items = test_items(e.dataset, max_test)
        entry: dict[str, Any] = {"dataset": e.source_dataset, "view": e.dataset.name,
                                 "n_classes": len(e.dataset.classnames), "templates": list(prompts)}
        scorer, how, reason = scorer_for(adapter, e, prompts, trained_on=e.dataset is plan.train)
        if scorer is None:
            log.info("%s: n/a (%s)", e.name, reason)
            out[e.name] = {"top1": None, "per_class": None, "n_test": len(items), **entry, "scored_by": None,
                           "reason": reason}
            continue
        features = RunFeatures(adapter, e.dataset, None, train_cfg, seed=seed, cache=cache, cost=cost,
                               batch_size=batch_size, workers=workers)
        feats, labels = features.test(items)
        out[e.name] = {**evaluate(scorer, feats, labels, e.dataset.classnames, amp=amp), **entry, "scored_by": how}
    return out


def target_names(evals: dict[str, Any]) -> list[str]:
    """The targets of a transfer protocol's test sets (every one but ``source``), in order."""
    return [k for k in evals if k != "source"]


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}%"


def describe_evals(protocol: str, evals: dict[str, dict[str, Any]]) -> str:
    """A run's accuracies in one line: base, new and H; or the source, each target and their average."""
    top1 = {k: v["top1"] for k, v in evals.items()}
    if protocol == "base2new":
        b, n = top1["base"], top1["new"]
        return f"base {_pct(b)}, new {_pct(n)}, H {_pct(None if b is None or n is None else harmonic_mean(b, n))}"
    if protocol == "fewshot":
        return f"top-1 {_pct(top1['all'])}"
    targets = target_names(top1)
    scored = [top1[t] for t in targets if top1[t] is not None]
    average = sum(scored) / len(scored) if scored and len(scored) == len(targets) else None
    return (f"source {_pct(top1['source'])}; " + ", ".join(f"{t} {_pct(top1[t])}" for t in targets)
            + f"; average over targets {_pct(average)}")
