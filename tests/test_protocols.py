"""The generalisation protocols' data side: base-to-novel, cross-dataset and domain-shift plans and their records."""
import json
from collections import Counter

import numpy as np
import pytest
import torch

from fewclip.data.protocols import (
    CROSS_DATASET_TARGETS,
    DOMAIN_SHIFT_TARGETS,
    PROTOCOLS,
    ClassSubset,
    base2new_table,
    base_new_classes,
    check_protocol_json,
    class_map,
    class_subset,
    default_targets,
    harmonic_mean,
    make_plan,
    plan_base2new,
    plan_cross_dataset,
    plan_domain_shift,
    protocol_json,
    read_protocol_split,
    restrict_logits,
    write_protocol_split,
)
from fewclip.datasets import DATASETS, DataConfig, Dataset, DatasetError, FewShotSplit, Item, build_dataset, make_few_shot_split


class Recording(Dataset):
    """A dataset whose images are never files: load_image records the item it is asked for."""

    hflip_ok = False
    min_crop_scale = 0.5

    def __post_init__(self):
        super().__post_init__()
        self.asked = []

    def load_image(self, item):
        self.asked.append(item)
        from PIL import Image

        return Image.new("RGB", (2, 2), (item.label, 0, 0))


def small(n_classes=5, per_class=(4, 2, 3), class_ids=None, name="small"):
    splits = {}
    for split, k in zip(("train", "val", "test"), per_class):
        splits[split] = [Item(f"{split}/{c}_{i}", c) for c in range(n_classes) for i in range(k)]
    return Recording(name, [f"class {c}" for c in range(n_classes)], ["a photo of a {}.", "a {}."], splits,
                     class_ids=list(class_ids or []))


@pytest.fixture(scope="module")
def toy():
    return {name: build_dataset(DataConfig(name=name))
            for name in ("toy-objects", "toy-shapes", "toy-sketch", "toy-shapes-outline", "toy-shapes-faded",
                         "toy-colours")}


# ---------------------------------------------------------------- the base/new rule


@pytest.mark.parametrize("n,n_base", [(2, 1), (5, 3), (10, 5), (37, 19), (47, 24), (64, 32), (397, 199)])
def test_base_classes_are_the_first_ceil_half(n, n_base):
    # CoCoOp's subsample_classes: m = ceil(n / 2); OxfordPets (37) -> 19 base, DTD (47) -> 24, SUN397 -> 199
    base, new = base_new_classes(n)
    assert base == list(range(n_base)) and new == list(range(n_base, n))


@pytest.mark.parametrize("n", [0, 1, -3, 2.0, True])
def test_base_new_split_needs_two_classes(n):
    with pytest.raises(DatasetError, match="at least 2 classes"):
        base_new_classes(n)


def test_harmonic_mean_reproduces_cocoops_averages():
    # CoCoOp (Zhou et al., CVPR 2022), Table 1, average over 11 datasets, ViT-B/16: base / new / H
    for base, new, hm in [(69.34, 74.22, 71.70), (82.69, 63.22, 71.66), (80.47, 71.69, 75.83)]:
        assert harmonic_mean(base, new) == pytest.approx(hm, abs=0.006)
    assert harmonic_mean(0.0, 0.0) == 0.0 and harmonic_mean(50.0, 0.0) == 0.0
    assert harmonic_mean(40.0, 40.0) == pytest.approx(40.0)


def test_base2new_table_averages_base_and_new_before_the_harmonic_mean():
    table = base2new_table({"a": (90.0, 10.0), "b": (50.0, 50.0)})
    assert table["a"] == {"base": 90.0, "new": 10.0, "hm": pytest.approx(18.0)}
    assert table["b"]["hm"] == pytest.approx(50.0)
    # average row: HM(70, 30) = 42, not the mean of the rows' HMs (34)
    assert table["average"] == {"base": 70.0, "new": 30.0, "hm": pytest.approx(42.0)}
    assert list(base2new_table({"a": (1.0, 2.0)})) == ["a"]


# ---------------------------------------------------------------- class subsets


def test_class_subset_relabels_in_the_given_order_and_keeps_the_images():
    ds = small(class_ids=[f"n{c:08d}" for c in range(5)])
    view = ClassSubset(ds, [3, 1], "pick")
    assert view.name == "small[pick]" and view.classnames == ["class 3", "class 1"]
    assert view.class_ids == ["n00000003", "n00000001"] and view.templates == ds.templates
    assert view.hflip_ok is False and view.min_crop_scale == 0.5  # the parent's augmentation hints
    for split in ("train", "val", "test"):
        want = [Item(it.id, {3: 0, 1: 1}[it.label]) for it in ds.items(split) if it.label in (3, 1)]
        assert view.items(split) == want
    # ids are unchanged; the image comes from the parent, asked with the parent's label
    item = next(it for it in view.items("test") if it.label == 0)
    assert item == Item("test/3_0", 0)
    im = view.load_image(item)
    assert ds.asked == [Item("test/3_0", 3)] and im.getpixel((0, 0))[0] == 3
    assert class_subset(ds, [0, 2]).name.startswith("small[classes-")
    assert class_subset(ds, [0, 2]).name != class_subset(ds, [0, 3]).name


@pytest.mark.parametrize("classes,message", [([], "at least one class"), ([0, 5], r"\[5\] are not labels"),
                                             ([-1], "not labels"), ([2, 2], "lists a class twice")])
def test_class_subset_rejects_bad_classes(classes, message):
    with pytest.raises(DatasetError, match=message):
        ClassSubset(small(), classes, "x")


def test_restrict_logits_keeps_the_target_columns_in_order():
    logits = torch.tensor([[0.1, 0.9, 0.3, 0.5], [0.7, 0.2, 0.8, 0.1]])
    got = restrict_logits(logits, [2, 0])
    assert torch.equal(got, torch.tensor([[0.3, 0.1], [0.8, 0.7]]))
    # argmax among the kept classes, which the full argmax (class 1 for the first row) is not
    assert got.argmax(-1).tolist() == [0, 0]
    assert np.array_equal(restrict_logits(logits.numpy(), [3]), logits.numpy()[:, [3]])


# ---------------------------------------------------------------- base-to-novel


def test_base2new_plan_on_toy_objects(toy):
    ds = toy["toy-objects"]
    plan = plan_base2new(ds)
    base, new = plan.eval_set("base"), plan.eval_set("new")
    assert plan.train is base.dataset and plan.train_classes == list(range(32)) == base.classes
    assert base.dataset.classnames == ds.classnames[:32] and new.dataset.classnames == ds.classnames[32:]
    assert base.dataset.classnames[0] == "red circle" and new.dataset.classnames[0] == "purple circle"
    assert base.class_map == list(range(32)) and new.class_map is None and new.classes == list(range(32, 64))
    # base test images among base classes, new among new; together, the whole test split, each once
    test = ds.items("test")
    assert Counter(it.label for it in base.test_items()) == {y: 100 for y in range(32)}
    assert Counter(it.label for it in new.test_items()) == {y: 100 for y in range(32)}
    both = [Item(it.id, it.label) for it in base.test_items()] + [Item(it.id, it.label + 32) for it in new.test_items()]
    assert sorted(both, key=lambda it: it.id) == sorted(test, key=lambda it: it.id)
    # the training split sees no new class
    assert not {it.id for it in plan.train.items("train")} & {it.id for it in ds.items("train") if it.label >= 32}
    sub = new.test_items(max_test=64, seed=1)
    assert len(sub) == 64 and Counter(it.label for it in sub) == {y: 2 for y in range(32)}


def test_base_shots_are_the_few_shot_protocols_shots_of_those_classes(toy):
    # CoOp draws the shots from all classes and then keeps the base ones; drawing from the base
    # view with the same seed gives the same images, so base-to-novel and few-shot runs of a seed share them.
    ds = toy["toy-objects"]
    plan = plan_base2new(ds)
    for seed in (1, 2):
        full = make_few_shot_split(ds, 16, seed)
        on_base = make_few_shot_split(plan.train, 16, seed)
        assert on_base.train == [it for it in full.train if it.label < 32]
        assert on_base.val == [it for it in full.val if it.label < 32]
        assert on_base.classnames == ds.classnames[:32]


def test_base2new_needs_test_images_in_both_halves():
    ds = small(4, per_class=(2, 1, 1))  # two classes per half: a one-class half is refused for another reason
    ds.splits["test"] = [it for it in ds.splits["test"] if it.label < 2]
    with pytest.raises(DatasetError, match=r"small\[new\] has no test images"):
        plan_base2new(ds)


# ---------------------------------------------------------------- cross-dataset and domain shift


def test_cross_dataset_plan_tests_each_target_among_its_own_classes(toy):
    src = toy["toy-objects"]
    plan = plan_cross_dataset(src, [toy["toy-shapes"], toy["toy-colours"]])
    assert plan.train is src and plan.train_classes == list(range(64))
    assert [e.name for e in plan.evals] == ["source", "toy-shapes", "toy-colours"]
    assert plan.evals[0].class_map == list(range(64))
    for e, target in zip(plan.evals[1:], ("toy-shapes", "toy-colours")):
        assert e.dataset is toy[target] and e.class_map is None
        assert e.dataset.classnames == toy[target].classnames and e.classes == list(range(8))
    with pytest.raises(DatasetError, match="distinct and differ from the source"):
        plan_cross_dataset(src, [toy["toy-shapes"], src])
    with pytest.raises(DatasetError, match="distinct"):
        plan_cross_dataset(src, [toy["toy-shapes"], toy["toy-shapes"]])
    with pytest.raises(DatasetError, match="at least one target"):
        plan_cross_dataset(src, [])


def test_domain_shift_maps_targets_onto_the_source_classes(toy):
    plan = plan_domain_shift(toy["toy-shapes"], [toy["toy-sketch"], toy["toy-shapes-outline"],
                                                 toy["toy-shapes-faded"]])
    maps = {e.name: e.class_map for e in plan.evals}
    assert maps == {"source": list(range(8)), "toy-sketch": list(range(8)),
                    "toy-shapes-outline": [0, 2, 4, 6], "toy-shapes-faded": list(range(8))}
    outline = plan.eval_set("toy-shapes-outline")
    assert [toy["toy-shapes"].classnames[y] for y in outline.class_map] == outline.dataset.classnames
    # a target with other classes is no domain shift of this source
    with pytest.raises(DatasetError, match="toy-colours.*8 class name.*'red'"):
        plan_domain_shift(toy["toy-shapes"], [toy["toy-colours"]])


def test_class_map_prefers_class_ids_and_refuses_ambiguous_names():
    # ImageNet-like: two classes share a name ("crane", the bird and the machine), the wnids tell them apart
    src = small(4, class_ids=["n1", "n2", "n3", "n4"])
    src.classnames = ["crane", "goldfish", "crane", "tench"]
    tgt = small(2, class_ids=["n3", "n1"], name="subset")
    tgt.classnames = ["crane", "crane"]
    assert class_map(src, tgt) == [2, 0]
    tgt.class_ids = []  # without ids only the names are left, and they are ambiguous
    with pytest.raises(DatasetError, match="'crane' name several classes"):
        class_map(src, tgt)
    same = small(4, name="copy")
    same.classnames = list(src.classnames)
    assert class_map(src, same) == [0, 1, 2, 3]  # identical lists map to themselves, duplicates and all
    tgt.class_ids = ["n3", "n9"]
    with pytest.raises(DatasetError, match="1 class id.*'n9'"):
        class_map(src, tgt)


def test_a_restricted_source_classifier_is_the_targets_own_zero_shot_classifier(toy):
    """Evaluating a subset target among its classes: the target's own prompts give exactly the source
    prototypes at the mapped classes, so source logits restricted by class_map are the target's logits."""
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.features.encode import text_prototypes

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    src, tgt = toy["toy-shapes"], toy["toy-shapes-outline"]
    cmap = plan_domain_shift(src, [tgt]).eval_set(tgt.name).class_map
    p_src = text_prototypes(bb, src.classnames, src.prompts("ensemble"))
    p_tgt = text_prototypes(bb, tgt.classnames, tgt.prompts("ensemble"))
    torch.testing.assert_close(p_tgt, p_src[cmap], rtol=0, atol=1e-6)
    img = bb.geometry.embed_image(torch.randn(6, p_src.shape[-1]))
    torch.testing.assert_close(bb.geometry.logits(img, p_tgt),
                               restrict_logits(bb.geometry.logits(img, p_src), cmap), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- plans by name, default targets


def test_make_plan_dispatches_and_checks(toy):
    assert make_plan("base2new", toy["toy-objects"]).protocol == "base2new"
    fs = make_plan("fewshot", toy["toy-shapes"])
    assert fs.train is toy["toy-shapes"] and [e.name for e in fs.evals] == ["all"]
    assert make_plan("domain_shift", toy["toy-shapes"], [toy["toy-sketch"]]).evals[1].class_map == list(range(8))
    assert make_plan("cross_dataset", toy["toy-objects"], [toy["toy-sketch"]]).evals[1].class_map is None
    with pytest.raises(ValueError, match="protocol must be one of fewshot, base2new"):
        make_plan("base_to_new", toy["toy-objects"])
    with pytest.raises(DatasetError, match="takes no target datasets"):
        make_plan("base2new", toy["toy-objects"], [toy["toy-shapes"]])
    assert PROTOCOLS == ("fewshot", "base2new", "cross_dataset", "domain_shift")


def test_default_targets_are_registered_and_fit_their_source(toy):
    for table in (CROSS_DATASET_TARGETS, DOMAIN_SHIFT_TARGETS):
        for source, targets in table.items():
            assert source in DATASETS and all(t in DATASETS for t in targets) and source not in targets
    assert default_targets("domain_shift", "imagenet") == ("imagenet_v2", "imagenet_sketch", "imagenet_a",
                                                           "imagenet_r")
    assert len(default_targets("cross_dataset", "imagenet")) == 10  # CoCoOp's Table 2
    # the toy world's shift targets map onto their source's classes
    for source, targets in DOMAIN_SHIFT_TARGETS.items():
        if source.startswith("toy-"):
            src = build_dataset(DataConfig(name=source))
            plan_domain_shift(src, [build_dataset(DataConfig(name=t)) for t in targets])
    with pytest.raises(DatasetError, match="no default cross_dataset targets for 'toy-colours'"):
        default_targets("cross_dataset", "toy-colours")
    with pytest.raises(ValueError, match="has no targets"):
        default_targets("base2new", "toy-objects")


# ---------------------------------------------------------------- the record in the run directory


def test_protocol_record_round_trip(toy, tmp_path):
    ds = toy["toy-objects"]
    plan = plan_base2new(ds)
    split = make_few_shot_split(plan.train, 4, 3)
    path = write_protocol_split(plan, split, tmp_path / "protocol.json", max_test=640)
    obj = json.loads(path.read_text())
    assert obj == read_protocol_split(path)
    assert obj["format"] == "fewclip.protocol/1" and obj["protocol"] == "base2new"
    assert obj["base2new"]["base"] == list(range(32)) and obj["base2new"]["new"] == list(range(32, 64))
    assert "ceil(n/2)" in obj["base2new"]["rule"] and obj["source"]["classnames"] == ds.classnames
    assert obj["train"]["dataset"] == "toy-objects[base]" and obj["train"]["classes"] == list(range(32))
    again = FewShotSplit.from_json(obj["train"]["split"])
    assert again.train == split.train and again.val == split.val and again.classnames == ds.classnames[:32]
    assert len(again.train) == 4 * 32
    evals = {e["name"]: e for e in obj["evals"]}
    assert evals["new"]["classnames"] == ds.classnames[32:] and evals["new"]["class_map"] is None
    assert evals["new"]["dataset"] == "toy-objects" and evals["new"]["classes"] == list(range(32, 64))
    assert evals["base"]["n_test"] == evals["new"]["n_test"] == 640
    assert obj["test"] == {"max_test": 640, "subset_seed": 1}

    shift = plan_domain_shift(toy["toy-shapes"], [toy["toy-shapes-outline"]])
    rec = protocol_json(shift, make_few_shot_split(toy["toy-shapes"], 1, 1))
    assert "base2new" not in rec and rec["evals"][1]["class_map"] == [0, 2, 4, 6]
    assert rec["evals"][1]["n_test"] == 400 and rec["test"] == {"max_test": None, "subset_seed": None}
    with pytest.raises(DatasetError, match="not of 'toy-objects\\[base\\]'"):
        protocol_json(plan, make_few_shot_split(ds, 1, 1))  # a split of all 64 classes


@pytest.mark.parametrize("edit,message", [
    (lambda o: o.update(format="fewclip.fewshot/1"), "is not a protocol split"),
    (lambda o: o.update(protocol="base_to_new"), "'protocol' must be one of"),
    (lambda o: o["train"].pop("split"), "few-shot 'split'"),
    (lambda o: o["train"]["split"].update(shots="16"), "'shots' must be a int"),
    (lambda o: o.update(evals=[]), "non-empty list"),
    (lambda o: o["evals"][1]["classnames"].pop(), r"evals\[1\] \('new'\) lists 32 classes but 31"),
    (lambda o: o["evals"][0].update(class_map=[0]), r"evals\[0\] \('base'\) class_map has the wrong length"),
])
def test_malformed_protocol_records_are_named(toy, tmp_path, edit, message):
    plan = plan_base2new(toy["toy-objects"])
    obj = protocol_json(plan, make_few_shot_split(plan.train, 1, 1))
    check_protocol_json(obj)
    edit(obj)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(DatasetError, match=message):
        read_protocol_split(path)


def test_reading_a_missing_or_broken_record(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_protocol_split(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DatasetError, match="cannot read protocol split file"):
        read_protocol_split(tmp_path / "bad.json")
