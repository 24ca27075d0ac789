"""No validation image is ever a training image: every path that builds a run's few-shot split (protocols x
samplers x imported files of every format, including CoOp's pickles) on every benchmark tree of the CoOp fixture,
on ImageNet (whose CoOp draws train on images fewclip holds out for validation) and on a dataset whose split file
lists some images in both train and val."""
import json
import shutil
from itertools import product
from types import SimpleNamespace

import pytest

from fewclip.data.base import DataConfig, DatasetError, build_dataset
from fewclip.data.coop_sampler import draw_split
from fewclip.data.protocols import make_plan
from fewclip.data.split_files import write_file
from fewclip.data.splits import FewShotSplit, check_val_apart
from helpers.coop_trees import DATASETS, FIXTURE, REF, make_tree

PROTOCOLS = ("fewshot", "base2new", "cross_dataset")
SAMPLERS = ("fewclip", "coop")
FILES = (("zhou", "s.json"), ("2sfs", "s_train.jsonl"), ("manifest", "s.csv"), ("manifest", "s.txt"),
         ("fewclip", "split.json"))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("apart")
    for name in DATASETS:
        make_tree(root, name)
    # a split file that lists three training images in val too (the dataset overlaps; a split must not)
    leaky = root / "dtd_leaky"
    shutil.copytree(root / "dtd", leaky)
    split = json.loads((leaky / "split_zhou_DescribableTextures.json").read_text())
    split["val"] += split["train"][:3]
    (leaky / "leaky.json").write_text(json.dumps(split))
    out = {name: build_dataset(DataConfig(name=name, root=str(root))) for name in DATASETS}
    out["dtd_leaky"] = build_dataset(DataConfig(name="dtd", root=str(root), split_file=str(leaky / "leaky.json")))
    return out


def cfg(shots, seed, sampler, fewshot_file=None):
    """What few_shot_split reads of a run config."""
    return SimpleNamespace(adapter=SimpleNamespace(name="linear_probe"), shots=shots, seed=seed,
                           data=SimpleNamespace(fewshot_file=fewshot_file, allow_fewer_shots=True, sampler=sampler))


def apart(split: FewShotSplit) -> bool:
    return not {it.id for it in split.train} & {it.id for it in split.val}


def plan_of(datasets, name, protocol):
    target = datasets["eurosat" if name != "eurosat" else "dtd"]
    return make_plan(protocol, datasets[name], [target] if protocol == "cross_dataset" else [])


@pytest.mark.parametrize("name", [*DATASETS, "dtd_leaky"])
def test_drawn_splits_keep_validation_apart(datasets, name):
    from fewclip.runs.run import few_shot_split

    could_leak = 0
    for protocol, sampler, shots, seed in product(PROTOCOLS, SAMPLERS, (1, 2, 4), (1, 2, 3)):
        plan = plan_of(datasets, name, protocol)
        split = few_shot_split(cfg(shots, seed, sampler), plan)
        assert apart(split), (protocol, sampler, shots, seed)
        held = {it.id for it in plan.train.splits.get("val", [])}
        could_leak += bool({it.id for it in split.train} & held)  # training images the val pool holds
    if name in ("imagenet", "dtd_leaky"):
        assert could_leak  # the property is not vacuous here: these draws train on images of the val pool


@pytest.mark.parametrize("name", [*DATASETS, "dtd_leaky"])
def test_imported_splits_keep_validation_apart(datasets, name, tmp_path):
    from fewclip.runs.run import few_shot_split

    for (fmt, file), sampler, protocol, seed in product(FILES, SAMPLERS, PROTOCOLS, (1, 2)):
        source = datasets[name]
        written = draw_split(source, 2, seed, allow_fewer=True, sampler=sampler)  # a file of all classes
        path = tmp_path / f"{fmt}-{sampler}-{seed}" / file
        path.parent.mkdir(exist_ok=True)
        write_file(written, source, fmt, path)
        for run_seed in (seed, seed + 5):  # a file without val gets the run seed's draw of them
            split = few_shot_split(cfg(2, run_seed, "fewclip", str(path)), plan_of(datasets, name, protocol))
            assert apart(split), (fmt, file, sampler, protocol, seed, run_seed)


@pytest.mark.parametrize("name", ["oxford_pets", "fgvc_aircraft", "imagenet"])
def test_coops_own_pickles_keep_validation_apart(datasets, name):
    from fewclip.runs.run import few_shot_split

    path = str(FIXTURE / name / "split_fewshot" / "shot_2-seed_1.pkl")
    for protocol, run_seed in product(PROTOCOLS, (1, 2, 3)):  # a file without val: the run seed's draw of them
        split = few_shot_split(cfg(2, run_seed, "fewclip", path), plan_of(datasets, name, protocol))
        assert apart(split) and split.train, (protocol, run_seed)


def test_a_split_that_validates_on_training_images_is_refused():
    from fewclip.data.base import Item

    train = [Item("a.jpg", 0), Item("b.jpg", 1)]
    with pytest.raises(DatasetError, match=r"1 validation image\(s\) .* are also training images: 'b.jpg'"):
        check_val_apart(FewShotSplit(1, 1, train, [Item("b.jpg", 1), Item("c.jpg", 0)], dataset="d"))
    assert check_val_apart(FewShotSplit(1, 1, train, [Item("c.jpg", 0)])).val[0].id == "c.jpg"


def test_the_fixture_covers_every_benchmark():
    assert len(REF["datasets"]) == 11
