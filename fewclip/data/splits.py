"""Few-shot splits: which k images per class a run trains on, written down as JSON.

``sample_few_shot(labels, k, seed)`` draws k indices per class with its own
``random.Random(seed)``; nothing here touches the global RNG, and seed 0 is a
seed like any other. ``make_few_shot_split`` applies it to a dataset, k per
class from ``train`` and, as in CoOp, ``min(k, 4)`` per class from ``val``
(with a seed derived from ``seed``, so validation and training draws are
independent). ``write_split``/``read_split`` store the result next to the
results, so a reader can see exactly which images a number came from. CoOp's own
draw (``data.sampler=coop``) is ``fewclip.data.coop_sampler``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fewclip.data.base import Dataset, DatasetError, Item
from fewclip.utils.io import atomic_write_json

SPLIT_FORMAT = "fewclip.fewshot/1"

# As in CoOp: the few-shot validation set has min(shots, VAL_SHOTS_MAX) images per class.
VAL_SHOTS_MAX = 4


def derive_seed(seed: int, stream: str) -> int:
    """A seed for a named sub-stream of ``seed``: unrelated to it, the same on every machine."""
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _by_class(labels: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, y in enumerate(labels):
        groups[int(y)].append(i)
    return groups


def check_enough(groups: dict[int, list[int]], classes: Sequence[int], k: int,
                 classnames: Optional[Sequence[str]], allow_fewer: bool) -> None:
    """A ``DatasetError`` naming the classes of ``classes`` with fewer than ``k`` items in ``groups`` (label ->
    indices), unless ``allow_fewer``."""
    short = [y for y in classes if len(groups.get(y, ())) < k]
    if short and not allow_fewer:
        def name(y: int) -> str:
            return repr(classnames[y]) if classnames is not None else f"label {y}"

        listed = ", ".join(f"{name(y)} ({len(groups.get(y, ()))})" for y in short[:5])
        more = f" and {len(short) - 5} more" if len(short) > 5 else ""
        raise DatasetError(
            f"{len(short)} class(es) have fewer than shots={k} images to sample from: {listed}{more}; "
            f"set data.allow_fewer_shots=true to use all images of such classes"
        )


def sample_few_shot(
    labels: Sequence[int],
    k: int,
    seed: int,
    *,
    classnames: Optional[Sequence[str]] = None,
    allow_fewer: bool = False,
) -> list[int]:
    """Indices into ``labels``, ``k`` per class, ordered by (class, index).

    Classes are those present in ``labels``, or ``0..len(classnames)-1`` when
    ``classnames`` is given (so a class with no items at all is caught too).
    A class with fewer than ``k`` items is a ``DatasetError`` naming it, unless
    ``allow_fewer``, in which case all of its items are taken.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"shots must be an integer >= 1, got {k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r} (random.Random(-s) is random.Random(s))")
    rng = random.Random(seed)
    groups = _by_class(labels)
    classes = range(len(classnames)) if classnames is not None else sorted(groups)
    check_enough(groups, classes, k, classnames, allow_fewer)
    chosen: list[int] = []
    for y in classes:
        idx = groups.get(y, [])
        chosen += idx if len(idx) <= k else sorted(rng.sample(idx, k))
    return chosen


def subsample_test(items: Sequence[Item], max_n: int, seed: int) -> list[Item]:
    """At most ``max_n`` items, each class keeping its share (largest remainder), in the input order."""
    if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
        raise ValueError(f"data.max_test must be an integer >= 1, got {max_n!r}")
    if len(items) <= max_n:
        return list(items)
    groups = _by_class([it.label for it in items])
    total = len(items)
    quota = {y: len(idx) * max_n // total for y, idx in groups.items()}
    left = max_n - sum(quota.values())
    by_remainder = sorted(groups, key=lambda y: (-(len(groups[y]) * max_n % total), y))
    for y in by_remainder[:left]:
        quota[y] += 1
    rng = random.Random(seed)
    keep: list[int] = []
    for y in sorted(groups):
        keep += rng.sample(groups[y], quota[y])
    return [items[i] for i in sorted(keep)]


@dataclass
class FewShotSplit:
    """The images a few-shot run uses: ``shots`` per class of ``train``, a few per class of ``val``."""

    shots: int
    seed: int
    train: list[Item]
    val: list[Item]
    dataset: str = ""
    classnames: list[str] = field(default_factory=list)
    allow_fewer: bool = False
    # Where the split was read from (``data.fewshot_file``: path, format, sha256; ``fewclip.data.split_files``);
    # None: drawn by ``make_few_shot_split``.
    source: Optional[dict[str, Any]] = None
    # Which draw made it (``data.sampler``: "fewclip" or "coop", ``fewclip.data.coop_sampler``); written only when "coop",
    # so the split.json of a run of fewclip's draw is as before.
    sampler: str = "fewclip"

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": SPLIT_FORMAT,
            "dataset": self.dataset,
            "shots": self.shots,
            "seed": self.seed,
            "allow_fewer_shots": self.allow_fewer,
            "classnames": list(self.classnames),
            "train": [[it.id, it.label] for it in self.train],
            "val": [[it.id, it.label] for it in self.val],
        }
        if self.source is not None:
            out["source"] = dict(self.source)
        if self.sampler != "fewclip":
            out["sampler"] = self.sampler
        return out

    @classmethod
    def from_json(cls, obj: Any, *, source: str = "few-shot split") -> FewShotSplit:
        if not isinstance(obj, dict) or obj.get("format") != SPLIT_FORMAT:
            raise DatasetError(f"{source} is not a few-shot split (expected \"format\": {SPLIT_FORMAT!r})")
        for key, typ in (("shots", int), ("seed", int), ("dataset", str), ("train", list), ("val", list)):
            if not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool):
                raise DatasetError(f"{source}: {key!r} must be a {typ.__name__}, got {obj.get(key)!r}")

        def items(key: str) -> list[Item]:
            out = []
            for i, row in enumerate(obj[key]):
                if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)
                        and isinstance(row[1], int) and not isinstance(row[1], bool) and row[1] >= 0):
                    raise DatasetError(f"{source}: {key}[{i}] = {row!r} is not [image id, label]")
                out.append(Item(row[0], row[1]))
            return out

        return cls(
            shots=obj["shots"],
            seed=obj["seed"],
            train=items("train"),
            val=items("val"),
            dataset=obj["dataset"],
            classnames=[str(c) for c in obj.get("classnames", [])],
            allow_fewer=bool(obj.get("allow_fewer_shots", False)),
            source=obj["source"] if isinstance(obj.get("source"), dict) else None,
            sampler=str(obj.get("sampler", "fewclip")),
        )


def make_few_shot_split(dataset: Dataset, shots: int, seed: int, allow_fewer: bool = False) -> FewShotSplit:
    """``shots`` per class from ``train`` (seed ``seed``) and ``min(shots, 4)`` per class from ``val``.

    Validation draws from a derived seed and takes what exists where a class
    has fewer validation images (or none, for a dataset without ``val``).
    """
    train = dataset.items("train")
    picked = sample_few_shot(
        [it.label for it in train], shots, seed, classnames=dataset.classnames, allow_fewer=allow_fewer
    )
    taken = {train[i].id for i in picked}
    val = [it for it in dataset.splits.get("val", []) if it.id not in taken]  # an image listed in both is training
    val_picked = sample_few_shot(
        [it.label for it in val], min(shots, VAL_SHOTS_MAX), derive_seed(seed, "val"), allow_fewer=True
    ) if val else []
    return FewShotSplit(
        shots=shots,
        seed=seed,
        train=[train[i] for i in picked],
        val=[val[i] for i in val_picked],
        dataset=dataset.name,
        classnames=list(dataset.classnames),
        allow_fewer=allow_fewer,
    )


def write_split(split: FewShotSplit, path: str | os.PathLike) -> Path:
    """Write ``split`` as JSON atomically (a reader never sees half a file); returns the path."""
    return atomic_write_json(path, split.to_json())


def read_split(path: str | os.PathLike) -> FewShotSplit:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"few-shot split file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read few-shot split file {path}: {e}") from None
    return FewShotSplit.from_json(obj, source=f"few-shot split file {path}")


# A test subset (data.max_test) is drawn with this seed, whatever the run's seed: every method and seed of a
# sweep, and `fewclip zeroshot`, are scored on the same images.
TEST_SUBSET_SEED = 1


def test_items(dataset: Dataset, max_test: Optional[int]) -> list[Item]:
    """The test images a run is scored on: all of them, or a class-stratified subset of ``max_test`` drawn with
    ``TEST_SUBSET_SEED``."""
    items = dataset.items("test")
    if max_test is not None and max_test < len(items):
        items = subsample_test(items, max_test, TEST_SUBSET_SEED)
    return items


def check_val_apart(split: FewShotSplit) -> FewShotSplit:
    """``split`` if none of its validation images is one of its training images, else a ``DatasetError`` naming
    them: a model chosen on validation images it trained on is chosen on nothing."""
    train = {it.id for it in split.train}
    both = [it.id for it in split.val if it.id in train]
    if both:
        listed = ", ".join(map(repr, both[:5])) + (f" and {len(both) - 5} more" if len(both) > 5 else "")
        raise DatasetError(f"{len(both)} validation image(s) of the few-shot split of {split.dataset!r} are also "
                           f"training images: {listed}; a split must keep them apart (fix the split file)")
    return split
