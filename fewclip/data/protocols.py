"""The generalisation protocols of prompt learning, as data: which classes and images a run trains and tests on.

Since CoCoOp (Zhou et al., "Conditional Prompt Learning for Vision-Language
Models", CVPR 2022) prompt-learning papers report, besides CoOp's few-shot
protocol:

* **base-to-novel** (``base2new``): the classes, sorted by label, are split in
  two; the first ``ceil(n / 2)`` are *base*, the rest *new*. A method trains on
  base classes only (16 shots by default), and is tested on the base classes'
  test images among the base classes and on the new classes' test images among
  the new classes; the table reports base, new and their harmonic mean. The
  rule is CoOp/CoCoOp's ``OxfordPets.subsample_classes`` (KaiyangZhou/CoOp,
  ``datasets/oxford_pets.py``): ``labels`` sorted, ``m = math.ceil(n / 2)``,
  ``base = labels[:m]``, ``new = labels[m:]``, each half relabelled
  ``0..k-1`` in label order. CoOp samples the few-shot images from all classes
  and then keeps the base ones; ``sample_few_shot`` draws class by class from
  one RNG, so drawing from the base view gives exactly the images that the
  few-shot protocol's split of the same seed has for those classes.
* **cross-dataset transfer** (``cross_dataset``): train on a source dataset
  with all its classes (ImageNet in the literature), then test the learned
  prompts on target datasets with *their own* class names.
* **domain generalisation** (``domain_shift``): train on a source, test on
  shifted versions of it that have the same classes (ImageNet-V2, -Sketch,
  -A, -R). ImageNet-A and -R hold 200 of the 1000 classes: their classes are
  mapped onto the source's labels by ImageNet wnid (``Dataset.class_ids``),
  and, as in CoOp/CoCoOp, a target is evaluated among its own classes only
  (its 200 class names; for a method with per-class parameters, the source
  logits restricted to those 200 columns: ``restrict_logits``).

A protocol is a ``ProtocolPlan``: the dataset the few-shot split is drawn from
and the adapter is built on (``train``), and the test sets (``evals``), each a
dataset whose labels run ``0..k-1`` over the class names a classifier is built
from, with ``class_map`` saying which training class each of its classes is
(``None`` where its classes were not trained on). ``protocol_json`` writes a
plan and its few-shot split as one JSON record (``write_protocol_split``), so a
reader of a run directory sees which classes were base and new, which images
were the shots and what every test set held.

Nothing here loads images or touches a global RNG; the functions are pure and
take built ``Dataset`` objects.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from PIL import Image

from fewclip.data.base import Dataset, DatasetError, Item
from fewclip.data.splits import SPLIT_FORMAT, FewShotSplit, subsample_test
from fewclip.utils.io import atomic_write_json

PROTOCOLS = ("fewshot", "base2new", "cross_dataset", "domain_shift")
# The protocols that test on other datasets (targets) than the one trained on.
TRANSFER_PROTOCOLS = ("cross_dataset", "domain_shift")
PROTOCOL_FORMAT = "fewclip.protocol/1"

BASE2NEW_RULE = (
    "CoCoOp (KaiyangZhou/CoOp, datasets/oxford_pets.py, subsample_classes): classes sorted by label, "
    "the first ceil(n/2) are base, the rest new; each half relabelled 0..k-1 in label order"
)

# Default targets of a source, as in the literature (CoCoOp's Tables 2 and 3) and in the toy world.
# A sweep may name its own targets; these are what `protocol: cross_dataset` / `domain_shift` use by default.
CROSS_DATASET_TARGETS: dict[str, tuple[str, ...]] = {
    "imagenet": ("caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101", "fgvc_aircraft",
                 "sun397", "dtd", "eurosat", "ucf101"),
    "toy-objects": ("toy-shapes", "toy-sketch", "toy-patterns", "toy-positions", "toy-colours"),
}
DOMAIN_SHIFT_TARGETS: dict[str, tuple[str, ...]] = {
    "imagenet": ("imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"),
    # toy-sketch: a style rare in pretraining; toy-shapes-outline: 4 of the 8 classes (as A and R hold 200 of
    # ImageNet's 1000); toy-shapes-faded: a rendering shift never seen in pretraining.
    "toy-shapes": ("toy-sketch", "toy-shapes-outline", "toy-shapes-faded"),
}


# ---------------------------------------------------------------------------
# small pure functions
# ---------------------------------------------------------------------------


def base_new_classes(n_classes: int) -> tuple[list[int], list[int]]:
    """CoCoOp's split of labels ``0..n-1``: (base, new) = (first ceil(n/2), the rest)."""
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
        raise DatasetError(f"base-to-novel needs at least 2 classes, got {n_classes!r}")
    m = math.ceil(n_classes / 2)
    return list(range(m)), list(range(m, n_classes))


def harmonic_mean(base: float, new: float) -> float:
    """CoCoOp's HM of base and new accuracy: 2 b n / (b + n), 0 when both are 0."""
    return 0.0 if base + new == 0 else 2.0 * base * new / (base + new)


def restrict_logits(logits, class_map: Sequence[int]):
    """Logits [..., C_source] -> [..., k]: the columns of the target's classes, in the target's label order.

    This is how a classifier trained on all source classes is evaluated on a
    subset target (ImageNet-A/R: 200 of 1000 classes) among the target's
    classes only. Works on torch tensors and numpy arrays.
    """
    return logits[..., list(class_map)]


def class_map(source: Dataset, target: Dataset) -> list[int]:
    """For each class of ``target``, the label of the same class in ``source``.

    Classes are matched by ``class_ids`` (ImageNet wnids) where both datasets
    have them, else by class name. Identical class lists map to themselves
    (so duplicate names, as in some ImageNet class-name lists, are fine then).
    A target class that the source lacks, or a name that is ambiguous, is a
    ``DatasetError`` naming it.
    """
    if target.class_ids and source.class_ids:
        s_keys, t_keys, what = source.class_ids, target.class_ids, "class id"
    else:
        s_keys, t_keys, what = source.classnames, target.classnames, "class name"
    if list(s_keys) == list(t_keys):
        return list(range(len(t_keys)))
    index: dict[str, int] = {}
    ambiguous = set()
    for y, key in enumerate(s_keys):
        if key in index:
            ambiguous.add(key)
        index.setdefault(key, y)
    missing = [k for k in t_keys if k not in index]
    if missing:
        listed = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DatasetError(
            f"dataset {target.name!r} has {len(missing)} {what}(s) that {source.name!r} lacks: {listed}; "
            f"a domain-shift target must have the source's classes (pick a target of the same label space)"
        )
    bad = sorted(set(t_keys) & ambiguous)
    if bad:
        raise DatasetError(f"{what}(s) {', '.join(map(repr, bad[:5]))} name several classes of {source.name!r}; "
                           f"cannot map {target.name!r} onto it")
    return [index[k] for k in t_keys]


# ---------------------------------------------------------------------------
# a dataset restricted to some of its classes
# ---------------------------------------------------------------------------


class ClassSubset(Dataset):
    """A view of ``parent`` with only ``classes`` (parent labels), relabelled ``0..k-1`` in that order.

    Class names (and ``class_ids``) follow the new labels; templates,
    augmentation hints and images are the parent's. Item ids are unchanged, so
    a split written from the view names the same files as the parent. The name
    is ``"<parent>[<tag>]"`` (e.g. ``toy-objects[base]``), so caches keyed by
    dataset name never mix a view with its parent.
    """

    def __init__(self, parent: Dataset, classes: Sequence[int], tag: str):
        classes = [int(c) for c in classes]
        n = len(parent.classnames)
        if not classes:
            raise DatasetError(f"a class subset of {parent.name!r} needs at least one class")
        bad = [c for c in classes if not 0 <= c < n]
        if bad:
            raise DatasetError(f"classes {bad[:5]} are not labels of {parent.name!r} (0..{n - 1})")
        if len(set(classes)) != len(classes):
            raise DatasetError(f"a class subset of {parent.name!r} lists a class twice: {classes}")
        new_label = {c: i for i, c in enumerate(classes)}
        splits = {
            split: [Item(it.id, new_label[it.label]) for it in items if it.label in new_label]
            for split, items in parent.splits.items()
        }
        super().__init__(
            name=f"{parent.name}[{tag}]",
            classnames=[parent.classnames[c] for c in classes],
            templates=list(parent.templates),
            splits=splits,
            root=parent.root,
            class_ids=[parent.class_ids[c] for c in classes] if parent.class_ids else [],
        )
        self.parent = parent
        self.classes = classes
        self.tag = tag
        self.hflip_ok = parent.hflip_ok
        self.min_crop_scale = parent.min_crop_scale
        self.generator = parent.generator

    def image_path(self, item: Item):
        return self.parent.image_path(Item(item.id, self.classes[item.label]))

    def load_image(self, item: Item) -> Image.Image:
        return self.parent.load_image(Item(item.id, self.classes[item.label]))


def class_subset(dataset: Dataset, classes: Sequence[int], tag: Optional[str] = None) -> ClassSubset:
    """``dataset`` restricted to ``classes`` (its labels, in the order that becomes 0..k-1)."""
    if tag is None:
        tag = "classes-" + hashlib.sha1(",".join(map(str, classes)).encode()).hexdigest()[:8]
    return ClassSubset(dataset, classes, tag)


# ---------------------------------------------------------------------------
# protocol plans
# ---------------------------------------------------------------------------


@dataclass
class EvalSet:
    """One test set of a protocol run.

    ``dataset``'s labels run ``0..k-1`` over the class names the classifier is
    built from; ``classes`` are those labels in the dataset it came from
    (``source_dataset``). ``class_map[i]`` is the training label of class
    ``i``, or the whole map is ``None`` where these classes were not trained on
    (new classes, cross-dataset targets).
    """

    name: str
    dataset: Dataset
    source_dataset: str
    classes: list[int]
    class_map: Optional[list[int]]

    def test_items(self, max_test: Optional[int] = None, seed: int = 1) -> list[Item]:
        """The test images, the seeded class-stratified subset of ``max_test`` where set (as ``data.max_test``)."""
        items = self.dataset.items("test")
        if max_test is not None and max_test < len(items):
            items = subsample_test(items, max_test, seed)
        return list(items)


@dataclass
class ProtocolPlan:
    protocol: str
    train: Dataset  # the few-shot split is drawn from it; the adapter is built on its class names
    train_classes: list[int]  # its classes as labels of `source`
    source: Dataset
    evals: list[EvalSet]

    def eval_set(self, name: str) -> EvalSet:
        for e in self.evals:
            if e.name == name:
                return e
        raise KeyError(f"protocol {self.protocol!r} has no test set {name!r} (has: {[e.name for e in self.evals]})")


def _whole(dataset: Dataset, name: str, class_map_: Optional[list[int]]) -> EvalSet:
    return EvalSet(name, dataset, dataset.name, list(range(len(dataset.classnames))), class_map_)


def plan_fewshot(dataset: Dataset) -> ProtocolPlan:
    """CoOp's protocol: train and test on the same classes."""
    every = list(range(len(dataset.classnames)))
    return ProtocolPlan("fewshot", dataset, every, dataset, [_whole(dataset, "all", every)])


def plan_base2new(dataset: Dataset) -> ProtocolPlan:
    """Train on the base half; test base images among base classes and new images among new classes."""
    base, new = base_new_classes(len(dataset.classnames))
    base_view, new_view = ClassSubset(dataset, base, "base"), ClassSubset(dataset, new, "new")
    for view in (base_view, new_view):
        if not view.splits.get("test"):
            raise DatasetError(f"{view.name} has no test images; base-to-novel needs test images in both halves")
    return ProtocolPlan(
        "base2new", base_view, base, dataset,
        [EvalSet("base", base_view, dataset.name, base, list(range(len(base)))),
         EvalSet("new", new_view, dataset.name, new, None)],
    )


def _check_targets(source: Dataset, targets: Sequence[Dataset], protocol: str) -> None:
    if not targets:
        raise DatasetError(f"protocol {protocol!r} needs at least one target dataset besides {source.name!r}")
    names = [t.name for t in targets]
    if source.name in names or len(set(names)) != len(names):
        raise DatasetError(f"protocol {protocol!r}: targets {names} must be distinct and differ from the "
                           f"source {source.name!r}")


def plan_cross_dataset(source: Dataset, targets: Sequence[Dataset]) -> ProtocolPlan:
    """Train on ``source`` with all its classes; test on it and on each target among the target's own classes."""
    _check_targets(source, targets, "cross_dataset")
    every = list(range(len(source.classnames)))
    evals = [_whole(source, "source", every)] + [_whole(t, t.name, None) for t in targets]
    return ProtocolPlan("cross_dataset", source, every, source, evals)


def plan_domain_shift(source: Dataset, targets: Sequence[Dataset]) -> ProtocolPlan:
    """Train on ``source``; test on it and on shifted targets whose classes are (some of) the source's.

    Each target is evaluated among its own classes; ``class_map`` says which
    source class each is (``class_map``), so a per-class classifier can be
    restricted to them (``restrict_logits``).
    """
    _check_targets(source, targets, "domain_shift")
    every = list(range(len(source.classnames)))
    evals = [_whole(source, "source", every)] + [_whole(t, t.name, class_map(source, t)) for t in targets]
    return ProtocolPlan("domain_shift", source, every, source, evals)


def make_plan(protocol: str, source: Dataset, targets: Sequence[Dataset] = ()) -> ProtocolPlan:
    """The plan of ``protocol`` (one of ``PROTOCOLS``) for ``source`` (and its targets, where it has any)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if protocol in ("fewshot", "base2new"):
        if targets:
            raise DatasetError(f"protocol {protocol!r} takes no target datasets (got {[t.name for t in targets]})")
        return plan_fewshot(source) if protocol == "fewshot" else plan_base2new(source)
    return (plan_cross_dataset if protocol == "cross_dataset" else plan_domain_shift)(source, targets)


def default_targets(protocol: str, source: str) -> tuple[str, ...]:
    """The literature's (or the toy world's) targets of ``source`` for a transfer protocol."""
    table = {"cross_dataset": CROSS_DATASET_TARGETS, "domain_shift": DOMAIN_SHIFT_TARGETS}.get(protocol)
    if table is None:
        raise ValueError(f"protocol {protocol!r} has no targets (only cross_dataset and domain_shift do)")
    if source not in table:
        raise DatasetError(f"no default {protocol} targets for {source!r} (defaults exist for "
                           f"{', '.join(sorted(table))}); name the targets explicitly")
    return table[source]


# ---------------------------------------------------------------------------
# the record written next to the results
# ---------------------------------------------------------------------------


def protocol_json(plan: ProtocolPlan, split: Optional[FewShotSplit], *, max_test: Optional[int] = None,
                  test_seed: int = 1) -> dict[str, Any]:
    """The plan and its few-shot split as one JSON-able record (format ``fewclip.protocol/1``).

    ``train.split`` is the few-shot split exactly as ``split.json`` of the
    few-shot protocol writes it, with labels of ``train.dataset``'s view
    (``train.classes[label]`` is the label in ``source.dataset``); ``null`` for
    a run that trains on nothing (zero-shot). Each test
    set names its dataset, the labels it keeps (in that dataset), their class
    names in the order of its labels, the map onto training labels (or null)
    and how many test images it has with this ``max_test``.
    """
    if split is not None and split.classnames and list(split.classnames) != list(plan.train.classnames):
        raise DatasetError(f"the few-shot split is not of {plan.train.name!r}: its class names differ")
    record: dict[str, Any] = {
        "format": PROTOCOL_FORMAT,
        "protocol": plan.protocol,
        "source": {"dataset": plan.source.name, "classnames": list(plan.source.classnames)},
        "train": {"dataset": plan.train.name, "classes": list(plan.train_classes),
                  "split": split.to_json() if split is not None else None},
        "test": {"max_test": max_test, "subset_seed": test_seed if max_test is not None else None},
        "evals": [
            {"name": e.name, "dataset": e.source_dataset, "view": e.dataset.name, "classes": list(e.classes),
             "classnames": list(e.dataset.classnames), "class_map": e.class_map,
             "n_test": len(e.test_items(max_test, test_seed))}
            for e in plan.evals
        ],
    }
    if plan.protocol == "base2new":
        base, new = plan.eval_set("base"), plan.eval_set("new")
        record["base2new"] = {"rule": BASE2NEW_RULE, "n_classes": len(plan.source.classnames),
                              "base": list(base.classes), "new": list(new.classes)}
    return record


def check_protocol_json(obj: Any, *, source: str = "protocol split") -> dict[str, Any]:
    """``obj`` if it is a well-formed protocol record, else a ``DatasetError`` naming what is wrong."""
    if not isinstance(obj, dict) or obj.get("format") != PROTOCOL_FORMAT:
        raise DatasetError(f"{source} is not a protocol split (expected \"format\": {PROTOCOL_FORMAT!r})")
    if obj.get("protocol") not in PROTOCOLS:
        raise DatasetError(f"{source}: 'protocol' must be one of {PROTOCOLS}, got {obj.get('protocol')!r}")
    train = obj.get("train")
    if not isinstance(train, dict) or "split" not in train or not isinstance(train["split"], (dict, type(None))):
        raise DatasetError(f"{source}: 'train' must hold the few-shot 'split' ({SPLIT_FORMAT}), or null for a run "
                           f"that trains on nothing")
    if train["split"] is not None:
        FewShotSplit.from_json(train["split"], source=f"{source}, train.split")
    evals = obj.get("evals")
    if not isinstance(evals, list) or not evals:
        raise DatasetError(f"{source}: 'evals' must be a non-empty list of test sets")
    for i, e in enumerate(evals):
        if not isinstance(e, dict) or not {"name", "dataset", "classes", "classnames", "class_map"} <= set(e):
            raise DatasetError(f"{source}: evals[{i}] must have name, dataset, classes, classnames and class_map")
        if len(e["classes"]) != len(e["classnames"]):
            raise DatasetError(f"{source}: evals[{i}] ({e['name']!r}) lists {len(e['classes'])} classes "
                               f"but {len(e['classnames'])} class names")
        if e["class_map"] is not None and len(e["class_map"]) != len(e["classes"]):
            raise DatasetError(f"{source}: evals[{i}] ({e['name']!r}) class_map has the wrong length")
    return obj


def write_protocol_split(plan: ProtocolPlan, split: Optional[FewShotSplit], path: str | os.PathLike, *,
                         max_test: Optional[int] = None, test_seed: int = 1) -> Path:
    """Write ``protocol_json(plan, split)`` atomically; returns the path."""
    return atomic_write_json(path, protocol_json(plan, split, max_test=max_test, test_seed=test_seed))


def read_protocol_split(path: str | os.PathLike) -> dict[str, Any]:
    """A protocol record written by ``write_protocol_split``, checked; its ``train.split`` as a ``FewShotSplit``
    is ``FewShotSplit.from_json(record["train"]["split"])`` (``None`` for a zero-shot run)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"protocol split file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read protocol split file {path}: {e}") from None
    return check_protocol_json(obj, source=f"protocol split file {path}")


def base2new_table(rows: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """CoCoOp's Table 1 from per-dataset (base, new) accuracies: base, new and HM per dataset, then an
    ``"average"`` row (with two or more datasets) whose HM is that of the averaged base and new, as the
    paper's average row is (CLIP ViT-B/16: 69.34 / 74.22 -> H 71.70), not the mean of the per-dataset HMs."""
    table = {name: {"base": b, "new": n, "hm": harmonic_mean(b, n)} for name, (b, n) in rows.items()}
    if len(rows) > 1:
        b = sum(r["base"] for r in table.values()) / len(table)
        n = sum(r["new"] for r in table.values()) / len(table)
        table["average"] = {"base": b, "new": n, "hm": harmonic_mean(b, n)}
    return table
