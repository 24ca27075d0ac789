"""Few-shot sampling: deterministic, class-balanced, seeded apart from the global RNG, stored as JSON."""
import json
import random
from collections import Counter

import pytest

from fewclip.data.base import Dataset, DatasetError, Item
from fewclip.data.splits import (
    FewShotSplit,
    make_few_shot_split,
    read_split,
    sample_few_shot,
    subsample_test,
    write_split,
)

# 3 classes with 20, 9 and 6 items, interleaved.
LABELS = [i % 3 for i in range(18)] + [0] * 14 + [1] * 3


def _dataset(train_per_class=(20, 9, 6), val_per_class=(7, 2, 0)) -> Dataset:
    def items(split, counts):
        return [Item(f"{split}/c{y}/{i}.png", y) for y, n in enumerate(counts) for i in range(n)]

    return Dataset(
        name="toy",
        classnames=["ant", "bee", "cat"],
        templates=["a photo of a {}."],
        splits={"train": items("train", train_per_class), "val": items("val", val_per_class),
                "test": items("test", (2, 2, 2))},
    )


def test_sample_is_deterministic_and_seeded():
    a = sample_few_shot(LABELS, 4, seed=1)
    assert a == sample_few_shot(LABELS, 4, seed=1)
    assert a != sample_few_shot(LABELS, 4, seed=2)
    zero = sample_few_shot(LABELS, 4, seed=0)
    assert zero == sample_few_shot(LABELS, 4, seed=0) and zero != a  # seed 0 is a real seed


def test_sample_ignores_and_keeps_global_rng():
    random.seed(123)
    state = random.getstate()
    a = sample_few_shot(LABELS, 4, seed=5)
    assert random.getstate() == state
    random.seed(999)
    assert sample_few_shot(LABELS, 4, seed=5) == a


def test_sample_is_class_balanced_and_ordered():
    for k in (1, 2, 4, 6):
        idx = sample_few_shot(LABELS, k, seed=3)
        assert Counter(LABELS[i] for i in idx) == {0: k, 1: k, 2: k}
        assert len(set(idx)) == len(idx)
        assert idx == sorted(idx, key=lambda i: (LABELS[i], i))


def test_fewer_than_k_names_the_class_and_the_flag():
    with pytest.raises(DatasetError, match="'cat' \\(6\\).*data.allow_fewer_shots=true"):
        sample_few_shot(LABELS, 8, seed=0, classnames=["ant", "bee", "cat"])
    with pytest.raises(DatasetError, match="label 2"):
        sample_few_shot(LABELS, 8, seed=0)
    # A class with no items at all is caught when the class names are given.
    with pytest.raises(DatasetError, match="'dog' \\(0\\)"):
        sample_few_shot(LABELS, 1, seed=0, classnames=["ant", "bee", "cat", "dog"])


def test_allow_fewer_takes_the_whole_short_class():
    idx = sample_few_shot(LABELS, 8, seed=0, classnames=["ant", "bee", "cat"], allow_fewer=True)
    assert Counter(LABELS[i] for i in idx) == {0: 8, 1: 8, 2: 6}


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_bad_k(k):
    with pytest.raises(ValueError, match="shots"):
        sample_few_shot(LABELS, k, seed=0)


def test_make_split_takes_k_train_and_min_k_4_val():
    ds = _dataset()
    split = make_few_shot_split(ds, shots=8, seed=0, allow_fewer=True)
    assert Counter(it.label for it in split.train) == {0: 8, 1: 8, 2: 6}
    assert Counter(it.label for it in split.val) == {0: 4, 1: 2}  # min(k, 4); short classes keep what exists
    assert set(split.train) <= set(ds.items("train")) and set(split.val) <= set(ds.items("val"))
    one = make_few_shot_split(ds, shots=1, seed=0)
    assert Counter(it.label for it in one.val) == {0: 1, 1: 1}
    assert one.dataset == "toy" and one.classnames == ds.classnames
    with pytest.raises(DatasetError, match="'cat'"):
        make_few_shot_split(ds, shots=8, seed=0)


def test_make_split_seeds_differ_and_val_stream_is_separate():
    ds = _dataset(train_per_class=(20, 20, 20), val_per_class=(20, 20, 20))
    a, b = make_few_shot_split(ds, 4, seed=0), make_few_shot_split(ds, 4, seed=1)
    assert a.train != b.train and a.val != b.val
    assert make_few_shot_split(ds, 4, seed=0) == a
    # Same pool sizes, but val is not drawn at the same positions as train.
    pos = lambda items, split: [ds.items(split).index(it) for it in items]  # noqa: E731
    assert pos(a.train, "train") != pos(a.val, "val")


def test_json_round_trip(tmp_path):
    split = make_few_shot_split(_dataset(), shots=2, seed=7)
    path = write_split(split, tmp_path / "runs" / "split.json")
    obj = json.loads(path.read_text())
    assert obj["dataset"] == "toy" and obj["shots"] == 2 and obj["seed"] == 7
    assert obj["train"][0] == [split.train[0].id, split.train[0].label]
    back = read_split(path)
    assert back == split
    assert FewShotSplit.from_json(split.to_json()) == split


def test_read_split_rejects_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_split(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"format": "fewclip.fewshot/1", "shots": 2, "seed": 0, '
                                       '"dataset": "x", "train": [["a.png", -1]], "val": []}')
    with pytest.raises(DatasetError, match="train\\[0\\]"):
        read_split(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(DatasetError, match="not a few-shot split"):
        read_split(tmp_path / "other.json")


def test_subsample_test_is_stratified_and_deterministic():
    items = [Item(f"{y}/{i}", y) for y, n in enumerate((50, 30, 20)) for i in range(n)]
    sub = subsample_test(items, 10, seed=0)
    assert Counter(it.label for it in sub) == {0: 5, 1: 3, 2: 2}
    assert sub == subsample_test(items, 10, seed=0) and sub != subsample_test(items, 10, seed=1)
    assert sub == sorted(sub, key=items.index)
    assert len(subsample_test(items, 7, seed=0)) == 7
    assert subsample_test(items, 1000, seed=0) == items
    with pytest.raises(ValueError, match="max_test"):
        subsample_test(items, 0, seed=0)
