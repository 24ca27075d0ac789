"""data.sampler=coop draws CoOp's few-shot images: pinned to Dassl's generate_fewshot_dataset run through CoOp's own
dataset readers (tests/fixtures/coop_fewshot/draws.json, made by tests/fixtures/coop_fewshot/make_draws.py) on small
trees of all 11 benchmarks whose split files list classes out of label order, with classes of exactly k and fewer
than k images."""
import os
import random
from pathlib import Path

import pytest

from fewclip.data.base import DataConfig, DatasetError, build_dataset
from fewclip.data.coop_sampler import coop_split, dassl_draw, draw_split
from fewclip.data.protocols import make_plan
from fewclip.data.splits import make_few_shot_split
from helpers.coop_trees import DATASETS, REF, make_tree


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("coop_data")
    for name in DATASETS:
        make_tree(root, name)
    return root


@pytest.fixture
def coop_listing(monkeypatch):
    """ImageNet's class folders listed in the order os.listdir gave CoOp's reader when the fixture was made (the
    file system's order, which a copy of the tree need not have)."""
    listing = REF["datasets"]["imagenet"]["tree"]["listing"]
    real = os.listdir

    def listdir(path="."):
        p = Path(path)
        if p.parent.name == "train" and p.name in listing:
            assert sorted(real(path)) == sorted(listing[p.name])
            return list(listing[p.name])
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)


def build(root: Path, name: str):
    return build_dataset(DataConfig(name=name, root=str(root)))


def expected(root: Path, ds, rows):
    """The fixture's [path under $DATA, label] as (fewclip id, label), sorted."""
    prefix = Path(ds.root).resolve().relative_to(root.resolve()).as_posix() + "/"
    assert all(p.startswith(prefix) for p, _ in rows)
    return sorted((p[len(prefix):], y) for p, y in rows)


def got(items):
    return sorted((it.id, it.label) for it in items)


def view(ds, subsample):
    if subsample == "all":
        return ds
    plan = make_plan("base2new", ds)
    return plan.train if subsample == "base" else plan.eval_set("new").dataset


@pytest.mark.parametrize("name", DATASETS)
def test_coop_sampler_draws_coops_images(data_root, coop_listing, name):
    ds = build(data_root, name)
    draws = REF["datasets"][name]["draws"]
    assert len(draws) == 27
    for key, ref in draws.items():
        shots, seed, sub = (part.split("=")[1] for part in key.split(","))
        split = coop_split(view(ds, sub), int(shots), int(seed), allow_fewer=True)
        assert got(split.train) == expected(data_root, ds, ref["train"]), key
        if ref["val"] is not None:
            assert got(split.val) == expected(data_root, ds, ref["val"]), key
        else:  # ImageNet: CoOp validates on its test set; here held-out images that are not training images
            held = {it.id for it in view(ds, sub).splits["val"]}
            assert {it.id for it in split.val} <= held - {it.id for it in split.train}
        assert split.to_json()["sampler"] == "coop"


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "imagenet"])
def test_dassl_draw_is_dassls_order_too(data_root, name):
    """Not only the same images: the same calls in the same order (train, then val from the same generator)."""
    ds = build(data_root, name)
    prefix = Path(ds.root).resolve().relative_to(data_root.resolve()).as_posix() + "/"
    for shots in (1, 2, 4):
        ref = REF["datasets"][name]["draws"][f"shots={shots},seed=2,subsample=all"]
        rng = random.Random(2)
        train, val = ds.items("train"), ds.items("val")
        t = [train[i].id for i in dassl_draw([it.label for it in train], shots, rng)]
        v = [val[i].id for i in dassl_draw([it.label for it in val], min(shots, 4), rng)]
        assert t == [p[len(prefix):] for p, _ in ref["train"]]
        assert v == [p[len(prefix):] for p, _ in ref["val"]]


def test_fewclips_own_draw_stays_the_default_and_differs_from_coops(data_root):
    """The trees' split files list classes out of label order and hold classes of exactly k images: fewclip's
    draw is not CoOp's there, which is why data.sampler=coop exists."""
    ds = build(data_root, "stanford_cars")
    assert DataConfig().sampler == "fewclip"
    ref = REF["datasets"]["stanford_cars"]["draws"]["shots=2,seed=1,subsample=all"]
    own = draw_split(ds, 2, 1, allow_fewer=True)
    assert got(own.train) == got(make_few_shot_split(ds, 2, 1, allow_fewer=True).train)
    assert got(own.train) != expected(data_root, ds, ref["train"])
    assert "sampler" not in own.to_json()


def test_coop_sampler_keeps_the_shots_check(data_root):
    ds = build(data_root, "dtd")
    with pytest.raises(DatasetError, match=r"fewer than shots=4 .*data.allow_fewer_shots=true"):
        coop_split(ds, 4, 1)
    with pytest.raises(ValueError, match="data.sampler must be"):
        DataConfig(sampler="dassl")


def test_a_run_with_sampler_coop_trains_on_coops_images(data_root, tmp_path):
    from fewclip.runs.run import build_plan, few_shot_split, load_train_config

    cfg = load_train_config(["adapter=linear_probe", "data.name=oxford_pets", f"data.root={data_root}",
                             "data.sampler=coop", "shots=2", "seed=3", "data.allow_fewer_shots=true",
                             "protocol=base2new"])
    plan = build_plan(cfg)
    split = few_shot_split(cfg, plan)
    ref = REF["datasets"]["oxford_pets"]["draws"]["shots=2,seed=3,subsample=base"]
    assert got(split.train) == expected(data_root, plan.source, ref["train"])
    assert got(split.val) == expected(data_root, plan.source, ref["val"])


def test_sampler_at_its_default_leaves_run_identities_and_splits_as_before(data_root, tmp_path, capsys):
    from fewclip.cli.main import main
    from fewclip.runs.records import config_dict
    from fewclip.runs.run import load_train_config

    assert "sampler" not in config_dict(load_train_config(["data=toy-shapes"]))["data"]
    assert config_dict(load_train_config(["data=toy-shapes", "data.sampler=coop"]))["data"]["sampler"] == "coop"
    args = ["data.name=ucf101", f"data.root={data_root}", "data.allow_fewer_shots=true", "shots=4", "seed=2"]
    path = tmp_path / "coop.csv"
    assert main(["split", "export", *args, "data.sampler=coop", "format=manifest", f"out={path}"]) == 0
    assert main(["split", "import", str(path), *args, "data.sampler=coop"]) == 0
    assert "(data.sampler=coop): the same training and validation images" in capsys.readouterr().out
    assert main(["split", "import", str(path), *args]) == 0
    assert "(data.sampler=fewclip): other training and validation images (" in capsys.readouterr().out
