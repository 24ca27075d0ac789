"""``data.sampler=coop``: the few-shot images CoOp trains and validates on, drawn as CoOp draws them.

CoOp (KaiyangZhou/CoOp @ff61507, ``datasets/*.py``) seeds Python's ``random``
with the run's seed (Dassl's ``set_random_seed``), then calls Dassl's
``DatasetBase.generate_fewshot_dataset`` (KaiyangZhou/Dassl.pytorch @c61a1b5,
``dassl/data/datasets/base_dataset.py``) on the training list with
``num_shots=shots`` and, from the same generator, on the validation list with
``min(shots, 4)``. That draw:

* takes the classes in the order in which they first occur in the list (the
  split file's order, not ascending labels);
* calls ``random.sample(items, k)`` for every class with at least ``k`` images,
  including a class of exactly ``k`` (the call uses the generator even though
  it returns all of them, reordered);
* takes all images of a class with fewer than ``k`` without a draw.

Base-to-novel: CoOp draws from all classes and then keeps a half
(``OxfordPets.subsample_classes``), so a class view (``protocols.ClassSubset``)
is drawn on its parent and cut. ImageNet: CoOp's training pool is every image
of ``images/train`` (fewclip holds some out as validation), class folders
sorted, each folder in ``os.listdir`` order (Dassl's ``listdir_nohidden``
without sorting: the file system's order, so CoOp's own ImageNet draw is
reproducible only on the same file system, or through its
``split_fewshot`` pickles); the benchmark gives that pool as
``dataset.coop_pool()``. CoOp validates ImageNet on its test set; here, as for
every dataset without a validation draw of CoOp's, validation images are
fewclip's seeded draw from the held-out images that are not training images.

fewclip's own draw (``splits.sample_few_shot``) differs in the first two points
and draws validation from a derived seed; it stays the default (README says
why). The split is ordered as fewclip's (by class, then training before held-out
images, then the dataset's order), so a CoOp pickle of the same images gives
the same split (``split_files``).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Optional

from fewclip.data.base import Dataset, DatasetError, Item
from fewclip.data.protocols import ClassSubset
from fewclip.data.splits import (
    VAL_SHOTS_MAX,
    FewShotSplit,
    check_enough,
    check_val_apart,
    derive_seed,
    make_few_shot_split,
    sample_few_shot,
)

log = logging.getLogger(__name__)

SAMPLERS = ("fewclip", "coop")


def dassl_draw(labels: Sequence[int], k: int, rng: random.Random) -> list[int]:
    """Indices into ``labels`` as Dassl's ``generate_fewshot_dataset(..., num_shots=k)`` picks them, in its order:
    classes in order of first occurrence, ``rng.sample`` of ``k`` where a class has at least ``k`` (exactly ``k``
    too), all of a class with fewer, no draw for it."""
    groups: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        groups.setdefault(int(y), []).append(i)
    out: list[int] = []
    for idx in groups.values():
        out += rng.sample(idx, k) if len(idx) >= k else idx
    return out


def _ordered(dataset: Dataset, items: Sequence[Item]) -> list[Item]:
    """``items`` by class, then training before held-out images, then the dataset's order."""
    where: dict[str, tuple[int, int]] = {}
    for rank, split in enumerate(("train", "val")):
        for i, it in enumerate(dataset.splits.get(split, [])):
            where.setdefault(it.id, (rank, i))
    return sorted(items, key=lambda it: (it.label, *where[it.id]))


def _drop_training(val: list[Item], train: Sequence[Item], dataset: Dataset) -> list[Item]:
    taken = {it.id for it in train}
    kept = [it for it in val if it.id not in taken]
    if len(kept) < len(val):  # CoOp would validate on them; a split file that lists an image in both
        log.warning("%s: %d validation image(s) of CoOp's draw are training images too and are left out",
                    dataset.name, len(val) - len(kept))
    return kept


def coop_split(dataset: Dataset, shots: int, seed: int, allow_fewer: bool = False) -> FewShotSplit:
    """The few-shot split CoOp draws for ``dataset`` with ``shots`` and ``seed`` (see the module's docstring)."""
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 1:
        raise ValueError(f"shots must be an integer >= 1, got {shots!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(dataset, ClassSubset):  # base-to-novel: drawn from all classes, then cut (subsample_classes)
        whole = coop_split(dataset.parent, shots, seed, allow_fewer=True)
        new = {c: i for i, c in enumerate(dataset.classes)}

        def cut(items: Sequence[Item]) -> list[Item]:
            return [Item(it.id, new[it.label]) for it in items if it.label in new]

        train, val = cut(whole.train), cut(whole.val)
    else:
        pool_of: Optional[Callable[[], list[Item]]] = getattr(dataset, "coop_pool", None)
        rng = random.Random(seed)  # Dassl's set_random_seed: random.seed(seed)
        if pool_of is None:
            pool, held = dataset.items("train"), dataset.splits.get("val", [])
            train = [pool[i] for i in dassl_draw([it.label for it in pool], shots, rng)]
            val_k = min(shots, VAL_SHOTS_MAX)
            val = _drop_training([held[i] for i in dassl_draw([it.label for it in held], val_k, rng)], train, dataset)
        else:  # ImageNet: CoOp draws training images only, from the whole training folder
            pool = pool_of()
            train = [pool[i] for i in dassl_draw([it.label for it in pool], shots, rng)]
            taken = {it.id for it in train}
            held = [it for it in dataset.splits.get("val", []) if it.id not in taken]
            picked = sample_few_shot([it.label for it in held], min(shots, VAL_SHOTS_MAX), derive_seed(seed, "val"),
                                     allow_fewer=True) if held else []
            val = [held[i] for i in picked]
        train, val = _ordered(dataset, train), _ordered(dataset, val)
    groups: dict[int, list[int]] = {}
    for i, it in enumerate(train):
        groups.setdefault(it.label, []).append(i)
    check_enough(groups, range(len(dataset.classnames)), shots, dataset.classnames, allow_fewer)  # short: all taken
    return check_val_apart(FewShotSplit(shots=shots, seed=seed, train=train, val=val, dataset=dataset.name,
                                        classnames=list(dataset.classnames), allow_fewer=allow_fewer,
                                        sampler="coop"))


def draw_split(dataset: Dataset, shots: int, seed: int, *, allow_fewer: bool = False,
               sampler: str = "fewclip") -> FewShotSplit:
    """A run's few-shot split of ``dataset`` by ``sampler`` (``data.sampler``): fewclip's draw or CoOp's."""
    if sampler == "fewclip":
        return check_val_apart(make_few_shot_split(dataset, shots, seed, allow_fewer=allow_fewer))
    if sampler == "coop":
        return coop_split(dataset, shots, seed, allow_fewer=allow_fewer)
    raise DatasetError(f"data.sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
